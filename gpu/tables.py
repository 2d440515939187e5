"""Constant tables of the GPU kernels, computed on the host with numpy (no cupy needed).

* :func:`crc_tables` -- CRC32C slicing-by-8 tables, the "shift by d zero bytes" multipliers
  (powers of x modulo the CRC32C polynomial) and nibble tables of the fixed shifts of the combine tree,
  which let every thread fold its own 64-byte piece and the block combine the pieces
  (``kernels/common.cuh``, ``okv_crc_unit``).
* :func:`finish_crc` / :func:`zero_crc` -- the host's last step: a kernel's raw CRC XOR the CRC32C of
  as many zero bytes (a compiled pass over a batch's distinct lengths: microseconds a batch).
* :func:`crc32c_model` -- a model of the older staged decomposition (64-byte pieces shifted to the
  segment's end); :func:`crc32c_braid_model` -- an emulation of the kernels' braided CRC (``okv_load_braid``,
  ``okv_crc8``, ``okv_crc_braid_unit``): per thread, lane and warp, every table word read through the
  kernels' shared-window addressing (OR-ed indexes, immediate offsets) at okv_load_braid's placement
  (:func:`braid_smem_layout`, :class:`BraidSmem`), so table layout and alignment are tested without a GPU.
* :func:`turboquant_tables` -- the float32 Lloyd-Max centroids and boundaries of
  :mod:`orbitkv_fs.codecs.turboquant` and the K encode's bucketize cells (:func:`turboquant_cells`), in
  the layout of ``kernels/turboquant.cu``; :func:`bucketize_by_cells` models that bucketize for tests.
* :func:`sign_words` -- TurboQuant's versioned random signs of a layer as 8 uint32 bit masks.

Invariant: the layout constants here (``PIECE``, ``CHUNK``, ``XP_OFFSET``, ``XC_OFFSET``, ``XC_COUNT``)
equal the ``#define`` s of ``kernels/common.cuh``.
"""

from __future__ import annotations

import functools

import numba
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
# Braided CRC (kernels/common.cuh, okv_crc_braid_unit): thread t of a unit folds the 8-byte words
# t, t + 256, ..., t + 7 * 256 with tables that also shift by the 255 words in between, then multiplies
# its register by x^(-64 t) (lane then warp nibble tables) so that the block's XOR is the unit's CRC.
BRAID_OFFSET = SHIFT_OFFSET + 128 * len(SHIFT_BYTES)  # 8 x 256: slicing tables times x^(64 * 255)
XN_OFFSET = BRAID_OFFSET + 8 * 256  # XN[z] = x^(-8z), z in 0..CHUNK
LANE_OFFSET = XN_OFFSET + CHUNK + 1  # word (i * 16 + v) * 32 + l = (v << 4i) * x^(-64 l)
WARP_OFFSET = LANE_OFFSET + 32 * 128  # word w * 128 + i * 16 + v = (v << 4i) * x^(-64 * 32 w)
TABLES_SIZE = WARP_OFFSET + 8 * 128


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
    nib = np.arange(16, dtype=np.uint32)[None, :] << (4 * np.arange(8, dtype=np.uint32)[:, None])  # [i][v]
    shifts = [gf_mul_vec(nib, np.uint32(int(xp[sb]))).reshape(-1) for sb in SHIFT_BYTES]
    braid = gf_mul_vec(np.stack(slices), np.uint32(int(xp[8 * (THREADS - 1)]))).reshape(-1)
    xn = np.empty(CHUNK + 1, dtype=np.uint32)
    v = X0
    for z in range(CHUNK + 1):
        xn[z] = v
        for _ in range(8):
            v = x_inv(v)
    lane = gf_mul_vec(nib[:, :, None], xn[8 * np.arange(32)][None, None, :]).reshape(-1)  # [i][v][l]
    warp = gf_mul_vec(nib[None, :, :], xn[256 * np.arange(8)][:, None, None]).reshape(-1)  # [w][i][v]
    out = np.concatenate([np.concatenate(slices), xp, xc, np.concatenate(shifts), braid, xn, lane, warp]).astype(np.uint32)
    assert out.size == TABLES_SIZE
    return out


def x_inv(v: int) -> int:
    """v * x^-1 modulo the CRC32C polynomial (reflected): the inverse of one step of "times x"."""
    return (((v ^ POLY) << 1) | 1) & 0xFFFFFFFF if v & 0x80000000 else (v << 1) & 0xFFFFFFFF


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


@numba.njit(cache=True, inline="always")
def _gf_mul_nb(a: np.uint32, b: np.uint32) -> np.uint32:  # pragma: no cover - compiled
    """:func:`gf_mul` compiled: a * b mod P, reflected."""
    p = np.uint32(0)
    for _ in range(32):
        if a & np.uint32(0x80000000):
            p ^= b
        a = a << np.uint32(1)
        b = (b >> np.uint32(1)) ^ (np.uint32(POLY) if b & np.uint32(1) else np.uint32(0))
    return p


_ZERO_MEMO = 8  # lengths _zero_crcs keeps at hand: a batch's classes (K, V, exact layers) are a few


@numba.njit(cache=True)
def _zero_crcs(n: np.ndarray, tab: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(n.size, dtype=np.uint32)
    seen = np.full(_ZERO_MEMO, -1, dtype=np.int64)  # the last lengths computed and their CRCs, in turn
    crc = np.zeros(_ZERO_MEMO, dtype=np.uint32)
    nxt = 0
    for i in range(n.size):
        m = n[i]
        for j in range(_ZERO_MEMO):
            if seen[j] == m:
                out[i] = crc[j]
                break
        else:  # x^(8n) from the kernels' tables (as x8n), then 0xFFFFFFFF times it
            x = _gf_mul_nb(tab[XC_OFFSET + m // CHUNK], tab[XP_OFFSET + m % CHUNK])
            out[i] = _gf_mul_nb(np.uint32(0xFFFFFFFF), x) ^ np.uint32(0xFFFFFFFF)
            seen[nxt], crc[nxt] = m, out[i]
            nxt = (nxt + 1) % _ZERO_MEMO
    return out


def zero_crc(n: "int | np.ndarray") -> np.ndarray:
    """crc32c of n zero bytes: what turns a raw (zero-init) CRC into the standard one. One compiled pass
    (the numpy form of the same multiplies cost about 150 us a call, which at 4 MiB was 25 us of host work
    per segment) that keeps the last few lengths at hand: a batch repeats a few, one per encode class, and a
    sort for the distinct ones cost more than the pass (an ANS batch has one per segment)."""
    n = np.asarray(n, dtype=np.int64)
    return _zero_crcs(n.reshape(-1), crc_tables()).reshape(n.shape)


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


# ---- Emulation of the braided kernels' shared memory (kernels/common.cuh, okv_load_braid) ---------------
# The kernels address their shared tables by shared-window byte address and OR the index bits into it
# ("(x & mask) | T", okv_lds_off<OFF> adding an immediate), which is only correct when T has zero bits where
# the index goes. On sm_90 the first 1 KiB of a block's shared window is reserved: static __shared__ arrays
# start at window address 0x400, so an __align__(N) array is only min(N, 1024)-aligned in the window. The
# lane tables need 2048-byte alignment (index bits 2..10), so okv_load_braid aligns them at run time inside
# one 1024-aligned array with slack. The model below reads every table word through that same addressing.
SMEM_WINDOW_BASE = 0x400  # sm_90: window address of the first static __shared__ byte
LANE_WORDS = 32 * 128
SLICE_WORDS = 8 * 256
WARP_WORDS = 8 * 128
BRAID_SMEM_WORDS = LANE_WORDS + SLICE_WORDS + WARP_WORDS + 512  # OKV_BRAID_SMEM_WORDS: tables + alignment slack


def braid_smem_layout(saddr: int) -> tuple[int, int, int]:
    """(aB, aL, aW): the window addresses okv_load_braid gives the braid, lane and warp tables in an array
    that starts at window address ``saddr`` (lane tables at the first 2048-aligned address, then braid, warp)."""
    assert saddr % 4 == 0
    a_l = saddr + ((-saddr) & 2047)
    assert a_l + 4 * (LANE_WORDS + SLICE_WORDS + WARP_WORDS) <= saddr + 4 * BRAID_SMEM_WORDS
    return a_l + 4 * LANE_WORDS, a_l, a_l + 4 * (LANE_WORDS + SLICE_WORDS)


class BraidSmem:
    """A block's shared window holding the braided CRC tables at window addresses (aB, aL, aW), with the
    kernels' lookups (okv_crc8, okv_mul_lane, okv_mul_nib16) emulated address for address."""

    def __init__(self, a_b: int, a_l: int, a_w: int) -> None:
        tab = crc_tables()
        self.a_b, self.a_l, self.a_w = a_b, a_l, a_w
        top = max(a_b + 4 * SLICE_WORDS, a_l + 4 * LANE_WORDS, a_w + 4 * WARP_WORDS)
        self.mem = np.zeros(top // 4 + 1, dtype=np.uint32)
        self.written = np.zeros(self.mem.size, dtype=bool)
        for a, off, words in ((a_b, BRAID_OFFSET, SLICE_WORDS), (a_l, LANE_OFFSET, LANE_WORDS),
                              (a_w, WARP_OFFSET, WARP_WORDS)):
            assert a % 4 == 0 and not self.written[a // 4:a // 4 + words].any(), "tables overlap"
            self.mem[a // 4:a // 4 + words] = tab[off:off + words]
            self.written[a // 4:a // 4 + words] = True

    def lds(self, addr: np.ndarray, off: int = 0) -> np.ndarray:
        """ld.shared.u32 [addr + off]."""
        a = np.asarray(addr, dtype=np.int64) + off
        assert (a % 4 == 0).all() and (a >= 0).all() and (a // 4 < self.mem.size).all(), "shared access out of range"
        assert self.written[a // 4].all(), "read of a shared word no table was loaded into"
        return self.mem[a // 4]

    def crc8(self, d: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """okv_crc8(d, lo, hi, aB)."""
        u = np.uint32
        lo = lo ^ d
        T = u(self.a_b)
        r = self.lds(((lo << u(2)) & u(0x3FC)) | T, 7168) ^ self.lds(((lo >> u(6)) & u(0x3FC)) | T, 6144)
        r ^= self.lds(((lo >> u(14)) & u(0x3FC)) | T, 5120) ^ self.lds(((lo >> u(22)) & u(0x3FC)) | T, 4096)
        r ^= self.lds(((hi << u(2)) & u(0x3FC)) | T, 3072) ^ self.lds(((hi >> u(6)) & u(0x3FC)) | T, 2048)
        r ^= self.lds(((hi >> u(14)) & u(0x3FC)) | T, 1024) ^ self.lds(((hi >> u(22)) & u(0x3FC)) | T)
        return r

    def mul_lane(self, v: np.ndarray, lane: np.ndarray) -> np.ndarray:
        """okv_mul_lane(v, aL + 4 * lane)."""
        u = np.uint32
        L = u(self.a_l) + u(4) * lane.astype(np.uint32)
        r = self.lds(((v << u(7)) & u(0x780)) | L)
        for i, sh in enumerate((3, -1, -5, -9, -13, -17, -21), start=1):
            x = (v << u(sh)) if sh > 0 else (v >> u(-sh))
            r ^= self.lds((x & u(0x780)) | L, 2048 * i)
        return r

    def mul_nib16(self, v: np.ndarray, S: np.ndarray) -> np.ndarray:
        """okv_mul_nib16(v, S)."""
        u = np.uint32
        S = np.asarray(S, dtype=np.uint32)
        r = self.lds(((v << u(2)) & u(0x3C)) | S)
        for i in range(1, 8):
            r ^= self.lds(((v >> u(4 * i - 2)) & u(0x3C)) | S, 64 * i)
        return r

    def braid_unit(self, lo: np.ndarray, hi: np.ndarray) -> int:
        """Thread registers d (8 okv_crc8 steps over words t + 256 k: lo/hi [8][THREADS]) and
        okv_crc_braid_unit's combine: the value thread 0 multiplies by the unit's shift and XORs in."""
        t = np.arange(THREADS)
        lane = t & 31
        d = np.zeros(THREADS, dtype=np.uint32)
        for k in range(8):
            d = self.crc8(d, lo[k], hi[k])
        v = self.mul_lane(d, lane)
        for o in (16, 8, 4, 2, 1):  # __shfl_xor_sync(FULL, v, o): lane l reads lane l ^ o of its warp
            v = v ^ v[(t & ~31) | (lane ^ o)]
        red = v[::32].copy()  # lane 0 of each warp
        l32 = np.arange(32)
        uu = np.zeros(32, dtype=np.uint32)
        live = l32 < THREADS // 32
        uu[live] = self.mul_nib16(red[l32[live]], np.uint32(self.a_w) + np.uint32(512) * l32[live].astype(np.uint32))
        for o in (4, 2, 1):
            uu = uu ^ uu[l32 ^ o]
        return int(uu[0])


@functools.lru_cache(maxsize=16)
def braid_smem(a_b: int, a_l: int, a_w: int) -> BraidSmem:
    return BraidSmem(a_b, a_l, a_w)


def _unit_words(unit: bytes) -> tuple[np.ndarray, np.ndarray]:
    """lo/hi [8][THREADS]: the little-endian 8-byte words t + 256 k of a unit, zero past its end."""
    words = np.zeros(CHUNK // 8, dtype="<u8")
    raw = np.frombuffer(unit + bytes(-len(unit) % 8), dtype="<u8")
    words[:raw.size] = raw
    lo = (words & 0xFFFFFFFF).astype(np.uint32).reshape(8, THREADS)
    hi = (words >> 32).astype(np.uint32).reshape(8, THREADS)
    return lo, hi


def braid_unit_raw(unit: bytes, layout: "tuple[int, int, int] | None" = None) -> int:
    """The block's XOR of okv_crc_braid_unit for one unit of at most CHUNK bytes (zero-padded at the tail
    to CHUNK): the raw CRC of the unit followed by CHUNK - len(unit) zero bytes, computed through the
    emulated shared tables at ``layout`` = (aB, aL, aW) (default: okv_load_braid's on sm_90)."""
    sm = braid_smem(*(layout or braid_smem_layout(SMEM_WINDOW_BASE)))
    return sm.braid_unit(*_unit_words(unit))


def okv_unit_mult(unit_start: int, n: int) -> int:
    """okv_unit_mult: the multiplier thread 0 applies to a (padded) unit starting at ``unit_start`` in n
    bytes: x^(8e) for e = n - (unit_start + CHUNK) >= 0, else XN[-e]."""
    tab = crc_tables()
    e = n - unit_start - CHUNK
    if e < 0:
        return int(tab[XN_OFFSET - e])
    if e == 0:
        return X0
    q, r = divmod(e, CHUNK)
    return gf_mul(int(tab[XC_OFFSET + q]), int(tab[XP_OFFSET + r])) if q else int(tab[XP_OFFSET + r])


def braid_pieces_acc(data: bytes, pieces: "list[tuple[int, int]]",
                     layout: "tuple[int, int, int] | None" = None) -> int:
    """Meta.acc after okv_crc_braid_unit for units (start, m) of ``data`` (m <= CHUNK; the kernels'
    units: okv_crc32c and okv_fp8_encode at multiples of CHUNK, okv_ans_pack at payload offsets)."""
    n = len(data)
    acc = 0
    for us, m in pieces:
        u = braid_unit_raw(data[us:us + m], layout)
        mult = okv_unit_mult(us, n)
        if u:  # thread 0: if (u) { if (mult != X0) u = gf_mul(u, mult); atomicXor }
            acc ^= gf_mul(u, mult) if mult != X0 else u
    return acc


def crc32c_braid_model(data: bytes, layout: "tuple[int, int, int] | None" = None) -> int:
    """CRC32C of ``data`` computed the way okv_crc32c computes it: 16 KiB units, each thread's braid register,
    the lane/warp combine read from the emulated shared tables, the shift to the end, finish_crc."""
    n = len(data)
    pieces = [(us, min(CHUNK, n - us)) for us in range(0, n, CHUNK)]
    return int(finish_crc(braid_pieces_acc(data, pieces, layout), n))


TQ_C4, TQ_C3 = 0, 16  # the centroids of each bit width (the kernels' TQ_C4 / TQ_C3)
TQ_B4, TQ_B3 = 24, 40  # the boundary slots of each bit width: boundary j at j, then +inf (TQ_B4 / TQ_B3)
TQ_CELLB4, TQ_CELLB3 = 48, 84  # the cell bytes (TQ_CELLS of them, in 36 words) of each bit width
TQ_TABLE_SIZE = 120  # float32 words (TQ_TAB)
TQ_CELLS = 129  # bucketize cells per bit width: q in [-4 + c/16, -4 + (c+1)/16) is cell c (128: q >= 4)
TQ_CELL_SLACK = 1.0 / 64  # each cell answers for q up to this far outside it (its index is computed in float)


def turboquant_cells(bits: int) -> np.ndarray:
    """uint8[TQ_CELLS]: per cell, 4 * base, base being the count of boundaries below the cell.

    The kernels' bucketize: cell = round(128 * sat(q/8 + 63.5/128)) (that is, round(16 q + 63.5) clamped
    to 0..128, in two fma instructions), its byte w4, then idx = base + (q > slots[base]) and the centroid
    of idx: three 32-bit shared-memory loads per element with few bank conflicts (a cell byte table of 33
    words; 2^bits slots; 2^bits centroids), where a 16-byte cell per element took about four times the
    load wavefronts. slots[base] is the first boundary not below the cell: inside it, or above it (then q
    cannot exceed it), or +inf. This equals the host's count of boundaries below q for every q whose
    computed cell is within TQ_CELL_SLACK of its true one, because a cell's widened range holds at most
    one boundary."""
    bnd = lloyd_max_boundaries(bits).astype(np.float32)
    out = np.zeros(TQ_CELLS, dtype=np.uint8)
    width = 1.0 / 16
    for c in range(TQ_CELLS):
        lo = -np.inf if c == 0 else -4.0 + c * width - TQ_CELL_SLACK
        hi = np.inf if c == TQ_CELLS - 1 else -4.0 + (c + 1) * width + TQ_CELL_SLACK
        inside = np.flatnonzero((bnd >= lo) & (bnd <= hi))
        if len(inside) > 1:
            raise ValueError(f"cell {c} of the {bits}-bit bucketize holds {len(inside)} boundaries")
        out[c] = 4 * int(np.count_nonzero(bnd < lo))
    return out


def turboquant_boundary_slots(bits: int) -> np.ndarray:
    """float32[2^bits]: the boundaries in order, then +inf."""
    return np.append(lloyd_max_boundaries(bits).astype(np.float32), np.float32(np.inf))


def bucketize_by_cells(q: np.ndarray, bits: int) -> np.ndarray:
    """The kernels' cell bucketize of float32 ``q`` (a model of okv_bucket4, for tests)."""
    cells = turboquant_cells(bits)
    slots = turboquant_boundary_slots(bits)
    # fma.rn.sat: q/8 + 63.5/128 rounded once (exact in float64, then rounded to float32), clamped to [0, 1]
    y = np.clip((q.astype(np.float64) * 0.125 + 0.49609375).astype(np.float32), 0, 1)
    y = np.nan_to_num(y, nan=0.0)  # the saturating fma answers 0 for NaN
    c = np.rint(y.astype(np.float64) * 128).astype(np.int64)  # the kernel adds 2^23: round half to even
    base = cells[c].astype(np.int64) // 4
    return base + (q > slots[base])


@functools.cache
def turboquant_tables() -> np.ndarray:
    """float32[TQ_TABLE_SIZE]: centroids(4) at TQ_C4, centroids(3) at TQ_C3, the boundary slots of each
    bit width at TQ_B4 / TQ_B3, then the cell bytes of each at TQ_CELLB4 / TQ_CELLB3 (4 per word)."""
    t = np.zeros(TQ_TABLE_SIZE, dtype=np.float32)
    t[TQ_C4:TQ_C4 + 16] = lloyd_max_centroids(4)
    t[TQ_C3:TQ_C3 + 8] = lloyd_max_centroids(3)
    t[TQ_B4:TQ_B4 + 16] = turboquant_boundary_slots(4)
    t[TQ_B3:TQ_B3 + 8] = turboquant_boundary_slots(3)
    raw = t.view(np.uint8)
    raw[4 * TQ_CELLB4:4 * TQ_CELLB4 + TQ_CELLS] = turboquant_cells(4)
    raw[4 * TQ_CELLB3:4 * TQ_CELLB3 + TQ_CELLS] = turboquant_cells(3)
    return t


@functools.cache
def sign_words(head_dim: int, layer: int, seed: int) -> tuple[int, ...]:
    """Eight uint32 words; bit j of the mask (word j // 32, bit j % 32) set means element j is negated."""
    neg = rotation_signs(head_dim, layer, seed) < 0
    bits = np.zeros(256, dtype=bool)
    bits[:head_dim] = neg
    words = np.packbits(bits, bitorder="little").view("<u4")
    return tuple(int(w) for w in words)
