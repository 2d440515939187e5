"""``turboquant-4`` / ``turboquant-3``: rotated Lloyd-Max K and per-vector uniform V. Lossy, experimental.

Owns the host reference of the TurboQuant format. The GPU kernels must produce the same bytes, so
every float operation below is specified in float32 with a fixed order (see docs/format.md):

* ``tree_sum`` halves the vector: ``s[:h] + s[h:]`` until one element remains.
* ``fwht`` is the unnormalised Walsh-Hadamard butterfly, stages h = 1, 2, ..., D/2, ``(a+b, a-b)``.
* No fused multiply-add: each product and sum is rounded on its own (CUDA: ``__fmul_rn``/``__fadd_rn``).

K (role key), per vector x of head_dim D, w = float32(x):
  norm = sqrt(tree_sum(w*w)); z = fwht(sign * w); q = z / norm (0 where norm == 0);
  idx = #{k : q > B_k} with B the Lloyd-Max boundaries of N(0, 1) (those of N(0, 1/D) scaled by sqrt(D));
  c = C[idx]; g = (norm * tree_sum(q*c)) / sqrt(tree_sum(c*c) * D), stored as FP16 -- the norm the
  reconstruction should have (norm correction); decode: fwht(c) * (g / sqrt(tree_sum(c*c) * D)) * sign.
V (role value), per vector: lo = fp16(min), sc = fp16((max - min) / (2**bits - 1));
  idx = clip(rint((w - lo) / sc), 0, 2**bits - 1) (0 where sc == 0); decode lo + idx * sc.
Record per vector: FP16 g (K) or FP16 lo, sc (V), then D*bits/8 bytes of codes packed LSB first.
Signs: bit 63 of splitmix64(((seed << 32) | (layer << 16) | j) ^ 0x4F524249544B5631); set means -1.

The per-vector work runs in numba kernels (blocks of 16 vectors, plain float32 operations, no fast-math,
so LLVM never contracts them into FMAs); the FP16 side values are rounded with numpy. The tests hold the
kernels to a scalar implementation of docs/format.md and to pinned SHA-256 test vectors.
"""

from __future__ import annotations

import numba
import numpy as np

from ..segment import TURBOQUANT_BITS, TURBOQUANT_HEAD_DIMS, RawReason, Role, SegmentHeader, turboquant_record_bytes
from .base import Codec, Declined, Encoded

SIGN_VERSION = 1
_SIGN_SALT = 0x4F524249544B5631  # "ORBITKV1"
_M64 = (1 << 64) - 1

# Lloyd-Max reconstruction levels of N(0, 1) (positive halves; the quantisers are symmetric),
# from Lloyd's iteration to 1e-15. Their MSE is 0.034548 (3 bits) and 0.009501 (4 bits).
_HALF_CENTROIDS = {
    3: (0.2450941789442220, 0.7560052812058782, 1.3439092785050004, 2.1519457045369866),
    4: (0.1283950298511470, 0.3880482994902900, 0.6567591185324632, 0.9423404564869610,
        1.2562311973471758, 1.6180463860218809, 2.0690172265313858, 2.7325895709951510),
}


def lloyd_max_centroids(bits: int) -> np.ndarray:
    """float32[2**bits] Lloyd-Max levels of N(0, 1), ascending."""
    half = np.array(_HALF_CENTROIDS[bits], dtype=np.float64)
    return np.concatenate([-half[::-1], half]).astype(np.float32)


def lloyd_max_boundaries(bits: int) -> np.ndarray:
    """float32[2**bits - 1] decision boundaries: midpoints of the float64 levels, rounded once."""
    half = np.array(_HALF_CENTROIDS[bits], dtype=np.float64)
    c = np.concatenate([-half[::-1], half])
    return ((c[:-1] + c[1:]) / 2).astype(np.float32)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def rotation_signs(head_dim: int, layer: int, seed: int = 0) -> np.ndarray:
    """float32[head_dim] of +-1: the versioned (v1) random signs of ``layer`` under ``seed``."""
    j = np.arange(head_dim, dtype=np.uint64)
    key = (np.uint64((seed & 0xFFFFFFFF) << 32) | np.uint64((layer & 0xFFFF) << 16) | j) ^ np.uint64(_SIGN_SALT)
    neg = (_splitmix64(key) >> np.uint64(63)).astype(bool)
    return np.where(neg, np.float32(-1), np.float32(1))


# Kernels work on blocks of ROWS vectors laid out [D, ROWS], so that every step is a loop over the
# block's vectors that LLVM turns into SIMD. error_model="numpy": a division by zero would give inf/NaN
# instead of raising (none is selected: q is 0 where the norm is 0), which lets the loops vectorise.
ROWS = 16
_JIT = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")


@numba.njit(**_JIT)
def _tree_sum_cols(s: np.ndarray, m: int, out: np.ndarray) -> None:
    """out[r] = sum of s[:, r] by halving (the order the GPU reproduces); overwrites ``s``."""
    n = s.shape[0]
    while n > 1:
        h = n // 2
        for i in range(h):
            for r in range(m):
                s[i, r] = s[i, r] + s[i + h, r]
        n = h
    for r in range(m):
        out[r] = s[0, r]


@numba.njit(**_JIT)
def _fwht_cols(a: np.ndarray, m: int) -> None:
    """In place, unnormalised Walsh-Hadamard butterfly over axis 0, stages h = 1, 2, ..., D/2."""
    d = a.shape[0]
    h = 1
    while h < d:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                for r in range(m):
                    x = a[j, r]
                    y = a[j + h, r]
                    a[j, r] = x + y
                    a[j + h, r] = x - y
        h *= 2


@numba.njit(**_JIT)
def _pack(idx: np.ndarray, r: int, bits: int, out: np.ndarray) -> None:
    """Codes idx[:, r] LSB first: code j in bits [j*bits, (j+1)*bits) of ``out``. D is a multiple of 8,
    so every 8 codes fill exactly ``bits`` bytes."""
    for g in range(idx.shape[0] // 8):
        acc = np.uint32(0)
        for i in range(8):
            acc |= np.uint32(idx[8 * g + i, r]) << np.uint32(bits * i)
        for b in range(bits):
            out[bits * g + b] = np.uint8((acc >> np.uint32(8 * b)) & np.uint32(0xFF))


@numba.njit(**_JIT)
def _unpack(packed: np.ndarray, bits: int, idx: np.ndarray, r: int) -> None:
    mask = np.uint32((1 << bits) - 1)
    for g in range(idx.shape[0] // 8):
        acc = np.uint32(0)
        for b in range(bits):
            acc |= np.uint32(packed[bits * g + b]) << np.uint32(8 * b)
        for i in range(8):
            idx[8 * g + i, r] = np.uint8((acc >> np.uint32(bits * i)) & mask)


@numba.njit(**_JIT)
def _encode_key_kernel(w, signs, bounds, cents, bits, g_out, codes_out):
    n, d = w.shape
    fd = np.float32(d)
    zero = np.float32(0)
    s = np.empty((d, ROWS), dtype=np.float32)
    z = np.empty((d, ROWS), dtype=np.float32)
    c = np.empty((d, ROWS), dtype=np.float32)
    idx = np.empty((d, ROWS), dtype=np.uint8)
    norm = np.empty(ROWS, dtype=np.float32)
    den = np.empty(ROWS, dtype=np.float32)
    dot = np.empty(ROWS, dtype=np.float32)
    for r0 in range(0, n, ROWS):
        m = min(ROWS, n - r0)
        for j in range(d):
            for r in range(m):
                x = w[r0 + r, j]
                s[j, r] = x * x
                z[j, r] = x * signs[j]
        _tree_sum_cols(s, m, norm)
        for r in range(m):
            norm[r] = np.sqrt(norm[r])
        _fwht_cols(z, m)
        for j in range(d):
            for r in range(m):
                z[j, r] = z[j, r] / norm[r] if norm[r] > zero else zero  # z becomes q
                idx[j, r] = 0
        for b in range(bounds.size):  # idx = number of boundaries below q (strictly)
            bound = bounds[b]
            for j in range(d):
                for r in range(m):
                    idx[j, r] += np.uint8(z[j, r] > bound)
        for j in range(d):
            for r in range(m):
                c[j, r] = cents[idx[j, r]]
                s[j, r] = c[j, r] * c[j, r]
        _tree_sum_cols(s, m, den)
        for j in range(d):
            for r in range(m):
                s[j, r] = z[j, r] * c[j, r]
        _tree_sum_cols(s, m, dot)
        for r in range(m):
            g_out[r0 + r] = (norm[r] * dot[r]) / np.sqrt(den[r] * fd)
            _pack(idx, r, bits, codes_out[r0 + r])


@numba.njit(**_JIT)
def _decode_key_kernel(g, codes, signs, cents, bits, out):
    n, d = out.shape
    fd = np.float32(d)
    s = np.empty((d, ROWS), dtype=np.float32)
    c = np.empty((d, ROWS), dtype=np.float32)
    idx = np.empty((d, ROWS), dtype=np.uint8)
    den = np.empty(ROWS, dtype=np.float32)
    for r0 in range(0, n, ROWS):
        m = min(ROWS, n - r0)
        for r in range(m):
            _unpack(codes[r0 + r], bits, idx, r)
        for j in range(d):
            for r in range(m):
                c[j, r] = cents[idx[j, r]]
                s[j, r] = c[j, r] * c[j, r]
        _tree_sum_cols(s, m, den)
        for r in range(m):
            den[r] = g[r0 + r] / np.sqrt(den[r] * fd)  # den becomes the scale
        _fwht_cols(c, m)
        for r in range(m):
            for j in range(d):
                out[r0 + r, j] = (c[j, r] * den[r]) * signs[j]


@numba.njit(**_JIT)
def _encode_value_kernel(w, lo, sc, bits, codes_out):
    n, d = w.shape
    levels = np.float32((1 << bits) - 1)
    zero = np.float32(0)
    idx = np.empty((d, 1), dtype=np.uint8)
    for r in range(n):
        for j in range(d):
            t = np.rint((w[r, j] - lo[r]) / sc[r]) if sc[r] > zero else zero
            idx[j, 0] = np.uint8(min(max(t, zero), levels))
        _pack(idx, 0, bits, codes_out[r])


@numba.njit(**_JIT)
def _decode_value_kernel(lo, sc, codes, bits, out):
    n, d = out.shape
    idx = np.empty((d, 1), dtype=np.uint8)
    for r in range(n):
        _unpack(codes[r], bits, idx, 0)
        for j in range(d):
            out[r, j] = lo[r] + np.float32(idx[j, 0]) * sc[r]


def _fp16_or_none(v: np.ndarray) -> np.ndarray | None:
    with np.errstate(over="ignore", invalid="ignore"):
        h = v.astype(np.float16)
    return h if np.all(np.isfinite(h)) else None


def encode_key(w: np.ndarray, bits: int, layer: int, seed: int = 0) -> np.ndarray | RawReason:
    """Records (uint8[n, rec]) of float32 key vectors ``w[n, D]``."""
    n, d = w.shape
    g = np.empty(n, dtype=np.float32)
    rec = np.empty((n, 2 + d * bits // 8), dtype=np.uint8)
    _encode_key_kernel(w, rotation_signs(d, layer, seed), lloyd_max_boundaries(bits), lloyd_max_centroids(bits),
                       bits, g, rec[:, 2:])
    g16 = _fp16_or_none(g)
    if g16 is None:
        return RawReason.OUT_OF_RANGE
    rec[:, :2] = g16.reshape(n, 1).view(np.uint8)
    return rec


def decode_key(rec: np.ndarray, bits: int, head_dim: int, layer: int, seed: int = 0) -> np.ndarray:
    """float32[n, D] reconstruction of key records."""
    g = np.ascontiguousarray(rec[:, :2]).view(np.float16).astype(np.float32)[:, 0]
    out = np.empty((rec.shape[0], head_dim), dtype=np.float32)
    _decode_key_kernel(g, rec[:, 2:], rotation_signs(head_dim, layer, seed), lloyd_max_centroids(bits), bits, out)
    return out


def encode_value(w: np.ndarray, bits: int) -> np.ndarray | RawReason:
    """Records (uint8[n, rec]) of float32 value vectors ``w[n, D]``."""
    n, d = w.shape
    levels = np.float32((1 << bits) - 1)
    lo = w.min(axis=1)
    lo16 = _fp16_or_none(lo)
    sc16 = _fp16_or_none((w.max(axis=1) - lo) / levels)
    if lo16 is None or sc16 is None:
        return RawReason.OUT_OF_RANGE
    rec = np.empty((n, 4 + d * bits // 8), dtype=np.uint8)
    rec[:, :4] = np.stack([lo16, sc16], axis=1).view(np.uint8)
    _encode_value_kernel(w, lo16.astype(np.float32), sc16.astype(np.float32), bits, rec[:, 4:])
    return rec


def decode_value(rec: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """float32[n, D] reconstruction of value records."""
    side = np.ascontiguousarray(rec[:, :4]).view(np.float16).astype(np.float32)
    out = np.empty((rec.shape[0], head_dim), dtype=np.float32)
    _decode_value_kernel(np.ascontiguousarray(side[:, 0]), np.ascontiguousarray(side[:, 1]), rec[:, 4:], bits, out)
    return out


class TurboQuantCodec(Codec):
    """TurboQuant at ``bits`` (3 or 4) with rotation ``seed``; K and V as in the module docstring."""

    exact = False

    def __init__(self, bits: int, seed: int = 0) -> None:
        if bits not in TURBOQUANT_BITS:
            raise ValueError(f"turboquant bits must be 3 or 4, not {bits}")
        self.bits = bits
        self.seed = seed

    @property
    def codec_id(self) -> str:  # type: ignore[override]
        return f"turboquant-{self.bits}"

    def get_config(self) -> dict:
        return {"id": self.codec_id, "bits": self.bits, "seed": self.seed}

    def encode(self, x: np.ndarray, *, role: Role, layer: int) -> Encoded | Declined:
        from .fp8 import BF16, FP16

        if np.dtype(x.dtype) not in (BF16, FP16):
            return Declined(RawReason.UNSUPPORTED, f"turboquant takes bf16/fp16, not {x.dtype}")
        if role not in (Role.KEY, Role.VALUE):
            return Declined(RawReason.UNSUPPORTED, "turboquant needs role key or value")
        d = x.shape[-1] if x.ndim else 0
        if d not in TURBOQUANT_HEAD_DIMS or not 0 <= layer <= 0xFFFF:
            return Declined(RawReason.UNSUPPORTED, f"head_dim {d} not in {TURBOQUANT_HEAD_DIMS}")
        w = np.ascontiguousarray(x).reshape(-1, d).astype(np.float32)
        if not np.all(np.isfinite(w)):
            return Declined(RawReason.NONFINITE, "nonfinite values")
        if role == Role.KEY:
            rec = encode_key(w, self.bits, layer, self.seed)
        else:
            rec = encode_value(w, self.bits)
        if isinstance(rec, RawReason):
            return Declined(rec, "norm, min or scale outside FP16")
        assert rec.shape[1] == turboquant_record_bytes(d, self.bits, role)
        return Encoded(payload=rec, bits=self.bits, head_dim=d, sign_version=SIGN_VERSION, rotation_seed=self.seed)

    def decode(self, header: SegmentHeader, payload: memoryview) -> np.ndarray:
        d, bits = header.head_dim, header.bits
        rec = np.frombuffer(payload, dtype=np.uint8).reshape(-1, turboquant_record_bytes(d, bits, header.role))
        if header.role == Role.KEY:
            w = decode_key(rec, bits, d, header.layer, header.rotation_seed)
        else:
            w = decode_value(rec, bits, d)
        with np.errstate(over="ignore"):  # a corrupt-but-CRC-valid record may hold huge values: inf, no warning
            return w.astype(header.dtype).reshape(-1)
