"""Constant tables of the GPU kernels, computed on the host with numpy (no cupy needed).

* :func:`crc_tables` -- CRC32C slicing-by-8 tables, the "shift by d zero bytes" multipliers
  (powers of x modulo the CRC32C polynomial) and nibble tables of the fixed shifts of the combine tree,
  which let every thread fold its own 64-byte piece and the block combine the pieces
  (``kernels/common.cuh``, ``okv_crc_unit``).
* :func:`finish_crc` / :func:`zero_crc` -- the host's last step: a kernel's raw CRC XOR the CRC32C of
  as many zero bytes (memoised per length, so a batch costs microseconds).
* :func:`crc32c_model` -- a model of exactly the kernels' decomposition (64-byte pieces shifted to the
  segment's end), so the combine arithmetic is tested on machines without a GPU.
* :func:`turboquant_tables` -- the float32 Lloyd-Max centroids and boundaries of
  :mod:`orbitkv_fs.codecs.turboquant`, in the layout of ``kernels/turboquant.cu``.
* :func:`sign_words` -- TurboQuant's versioned random signs of a layer as 8 uint32 bit masks.

Invariant: the layout constants here (``PIECE``, ``CHUNK``, ``XP_OFFSET``, ``XC_OFFSET``, ``XC_COUNT``)
equal the ``#define`` s of ``kernels/common.cuh``.
"""

from __future__ import annotations

import functools

import numpy as np

from orbitkv_fs.codecs.turboquant import lloyd_max_boundaries, lloyd_max_centroids, rotation_signs

POLY = 0x82F63B78
PIECE = 64
THREADS = 256
CHUNK = PIECE * THREADS
XP_OFFSET = 8 * 256
XC_OFFSET = XP_OFFSET + CHUNK + 1
XC_COUNT = 2049  # units of 16 KiB in the largest stored segment (32 MiB), plus one
SHIFT_OFFSET = XC_OFFSET + XC_COUNT
SHIFT_BYTES = (64, 128, 256, 512, 1024, 2048)  # the fixed shifts of the in-unit combine tree
X0 = 0x80000000  # x^0 in the reflected representation


def gf_mul(a: int, b: int) -> int:
    """a * b modulo the CRC32C polynomial, reflected (zlib's multmodp)."""
    p = 0
    for _ in range(32):
        if a & 0x80000000:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


@functools.cache
def crc_tables() -> np.ndarray:
    """uint32[XC_OFFSET + XC_COUNT]: slicing tables, XP[d] = x^(8d), XC[j] = x^(8*CHUNK*j)."""
    t0 = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t0 = np.where(t0 & 1, (t0 >> 1) ^ np.uint32(POLY), t0 >> 1).astype(np.uint32)
    slices = [t0]
    for _ in range(7):
        prev = slices[-1]
        slices.append((prev >> 8) ^ t0[prev & 0xFF])
    xp = np.empty(CHUNK + 1, dtype=np.uint32)
    v = X0
    t0l = t0.tolist()
    for d in range(CHUNK + 1):
        xp[d] = v
        v = t0l[v & 0xFF] ^ (v >> 8)  # one more zero byte: times x^8
    xc = np.empty(XC_COUNT, dtype=np.uint32)
    v, step = X0, int(xp[CHUNK])
    for j in range(XC_COUNT):
        xc[j] = v
        v = gf_mul(v, step)
    # "times x^(8s)" for the fixed shifts s, as nibble tables: entry [i][v] = (v << 4i) * x^(8s)
    shifts = [gf_mul_vec((np.arange(16, dtype=np.uint32)[None, :] << (4 * np.arange(8, dtype=np.uint32)[:, None])),
                         np.uint32(int(xp[sb]))).reshape(-1) for sb in SHIFT_BYTES]
    out = np.concatenate([np.concatenate(slices), xp, xc, np.concatenate(shifts)]).astype(np.uint32)
    assert out.size == SHIFT_OFFSET + 128 * len(SHIFT_BYTES)
    return out


def _raw_crc(data: bytes, t0: np.ndarray) -> int:
    crc = 0
    for b in data:
        crc = int(t0[(crc ^ b) & 0xFF]) ^ (crc >> 8)
    return crc


def gf_mul_vec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise :func:`gf_mul` of two uint32 arrays."""
    a = np.asarray(a, dtype=np.uint32).copy()
    b = np.asarray(b, dtype=np.uint32).copy()
    a, b = np.broadcast_arrays(a, b)
    a, b = a.copy(), b.copy()
    p = np.zeros(a.shape, dtype=np.uint32)
    for _ in range(32):
        p ^= np.where(a & np.uint32(0x80000000), b, np.uint32(0))
        a = a << np.uint32(1)
        b = (b >> np.uint32(1)) ^ np.where(b & np.uint32(1), np.uint32(POLY), np.uint32(0))
    return p


def x8n(n: "int | np.ndarray") -> np.ndarray:
    """x^(8n) mod P (uint32, reflected) for byte counts n < 2049 * CHUNK."""
    tab = crc_tables()
    n = np.asarray(n, dtype=np.int64)
    return gf_mul_vec(tab[XC_OFFSET + n // CHUNK], tab[XP_OFFSET + n % CHUNK])


@functools.lru_cache(maxsize=8192)
def _zero_crc_of(n: int) -> int:
    return int(gf_mul_vec(np.uint32(0xFFFFFFFF), x8n(n))) ^ 0xFFFFFFFF


def zero_crc(n: "int | np.ndarray") -> np.ndarray:
    """crc32c of n zero bytes: what turns a raw (zero-init) CRC into the standard one. Memoised per
    length: a batch holds few distinct lengths, and the 32-step carry-less multiply costs ~150 us per
    call however few elements it has."""
    n = np.asarray(n, dtype=np.int64)
    uniq, inv = np.unique(n, return_inverse=True)
    vals = np.array([_zero_crc_of(int(u)) for u in uniq], dtype=np.uint32)
    return vals[inv].reshape(n.shape)


def finish_crc(acc: "int | np.ndarray", n: "int | np.ndarray") -> np.ndarray:
    """Standard CRC32C from the kernels' Meta.acc (raw CRC of the n bytes walked)."""
    return np.asarray(acc, dtype=np.uint32) ^ zero_crc(n)


def _mul_shift(v: int, level: int, tab: np.ndarray) -> int:
    """v * x^(8 * SHIFT_BYTES[level]) through the nibble tables, as the kernels do it."""
    base = SHIFT_OFFSET + 128 * level
    r = 0
    for i in range(8):
        r ^= int(tab[base + 16 * i + ((v >> (4 * i)) & 15)])
    return r


def crc32c_model(data: bytes) -> int:
    """CRC32C of ``data`` computed the way the kernels compute it (slow; for tests): per 16 KiB unit,
    64-byte pieces combined by the shift tree (full units) or shifted one by one (the last unit), the
    unit shifted to the segment's end, all XORed, then :func:`finish_crc`."""
    tab = crc_tables()
    t0 = tab[:256]
    n = len(data)
    acc = 0
    for us in range(0, n, CHUNK):
        unit = data[us:us + CHUNK]
        m = len(unit)
        raws = [_raw_crc(unit[p:p + PIECE], t0) for p in range(0, m, PIECE)]
        if m == CHUNK:
            for k in range(5):  # lanes
                step = 1 << k
                raws = [_mul_shift(raws[i], k, tab) ^ raws[i + step] if i % (2 * step) == 0 else raws[i]
                        for i in range(THREADS)]
            warps = [raws[32 * w] for w in range(THREADS // 32)]
            u = warps[0]
            for w in warps[1:]:
                u = _mul_shift(u, 5, tab) ^ w
        else:
            u = 0
            for j, raw in enumerate(raws):
                d = m - j * PIECE - min(PIECE, m - j * PIECE)
                u ^= gf_mul(raw, int(tab[XP_OFFSET + d])) if d else raw
        d = n - (us + m)
        acc ^= gf_mul(u, int(x8n(d))) if d else u
    return int(finish_crc(acc, n))


TQ_TABLE_SIZE = 48


@functools.cache
def turboquant_tables() -> np.ndarray:
    """float32[48]: centroids(4 bits) at 0, boundaries(4) at 16, centroids(3) at 32, boundaries(3) at 40."""
    t = np.zeros(TQ_TABLE_SIZE, dtype=np.float32)
    t[0:16] = lloyd_max_centroids(4)
    t[16:31] = lloyd_max_boundaries(4)
    t[32:40] = lloyd_max_centroids(3)
    t[40:47] = lloyd_max_boundaries(3)
    return t


@functools.cache
def sign_words(head_dim: int, layer: int, seed: int) -> tuple[int, ...]:
    """Eight uint32 words; bit j of the mask (word j // 32, bit j % 32) set means element j is negated."""
    neg = rotation_signs(head_dim, layer, seed) < 0
    bits = np.zeros(256, dtype=bool)
    bits[:head_dim] = neg
    words = np.packbits(bits, bitorder="little").view("<u4")
    return tuple(int(w) for w in words)
