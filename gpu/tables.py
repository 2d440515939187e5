"""Constant tables of the GPU kernels, computed on the host with numpy (no cupy needed).

* :func:`crc_tables` -- CRC32C slicing-by-8 tables and the "shift by d zero bytes" multipliers
  (powers of x modulo the CRC32C polynomial) that let every thread fold its own 64-byte piece and
  combine the pieces in any order (``kernels/common.cuh``, ``okv_crc_unit``).
* :func:`crc32c_model` -- a numpy model of exactly that decomposition (pieces, 16 KiB units,
  segment combine), so the combine arithmetic is tested on machines without a GPU.
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
    out = np.concatenate([np.concatenate(slices), xp, xc]).astype(np.uint32)
    assert out.size == XC_OFFSET + XC_COUNT
    return out


def _raw_crc(data: bytes, t0: np.ndarray) -> int:
    crc = 0
    for b in data:
        crc = int(t0[(crc ^ b) & 0xFF]) ^ (crc >> 8)
    return crc


def crc32c_model(data: bytes) -> int:
    """CRC32C of ``data`` computed the way the kernels compute it (slow; for tests)."""
    tab = crc_tables()
    t0, xp, xc = tab[:256], tab[XP_OFFSET:XC_OFFSET], tab[XC_OFFSET:]
    n = len(data)
    if n == 0:
        return 0
    nb = -(-n // CHUNK)
    rseg = n - (nb - 1) * CHUNK
    acc = 0
    for b in range(nb):
        m = min(CHUNK, n - b * CHUNK)
        unit = 0
        for t in range(THREADS):
            ln = min(PIECE, m - t * PIECE)
            if ln <= 0:
                break
            raw = _raw_crc(data[b * CHUNK + t * PIECE: b * CHUNK + t * PIECE + ln], t0)
            d = m - t * PIECE - ln
            unit ^= gf_mul(raw, int(xp[d])) if d else raw
        if b + 1 < nb:
            unit = gf_mul(gf_mul(unit, int(xc[nb - 2 - b])), int(xp[rseg]))
        acc ^= unit
    return acc ^ gf_mul(0xFFFFFFFF, gf_mul(int(xc[nb - 1]), int(xp[rseg]))) ^ 0xFFFFFFFF


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
