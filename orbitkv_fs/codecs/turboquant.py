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
"""

from __future__ import annotations

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


def tree_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis by halving (the order the GPU reproduces)."""
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = a[..., :h] + a[..., h:]
    return a[..., 0]


def fwht(a: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform over the last axis, stages h = 1, 2, ..., D/2."""
    n, d = a.shape
    h = 1
    while h < d:
        v = a.reshape(n, d // (2 * h), 2, h)
        a = np.stack([v[:, :, 0, :] + v[:, :, 1, :], v[:, :, 0, :] - v[:, :, 1, :]], axis=2).reshape(n, d)
        h *= 2
    return a


def pack_codes(idx: np.ndarray, bits: int) -> np.ndarray:
    """uint8[n, D*bits/8]: code j of each row in bits [j*bits, (j+1)*bits), LSB first."""
    n, d = idx.shape
    bitplanes = ((idx[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1).astype(np.uint8)
    return np.packbits(bitplanes.reshape(n, d * bits), axis=1, bitorder="little")


def unpack_codes(packed: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    n = packed.shape[0]
    planes = np.unpackbits(packed, axis=1, bitorder="little").reshape(n, head_dim, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)


def _fp16_or_none(v: np.ndarray) -> np.ndarray | None:
    with np.errstate(over="ignore", invalid="ignore"):
        h = v.astype(np.float16)
    return h if np.all(np.isfinite(h)) else None


def encode_key(w: np.ndarray, bits: int, layer: int, seed: int = 0) -> np.ndarray | RawReason:
    """Records (uint8[n, rec]) of float32 key vectors ``w[n, D]``."""
    n, d = w.shape
    norm = np.sqrt(tree_sum(w * w))
    z = fwht(w * rotation_signs(d, layer, seed))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(norm[:, None] > 0, z / norm[:, None], np.float32(0))
    idx = (q[:, :, None] > lloyd_max_boundaries(bits)).sum(axis=2, dtype=np.uint8)
    c = lloyd_max_centroids(bits)[idx]
    den = np.sqrt(tree_sum(c * c) * np.float32(d))
    g = (norm * tree_sum(q * c)) / den
    g16 = _fp16_or_none(g)
    if g16 is None:
        return RawReason.OUT_OF_RANGE
    return np.concatenate([g16.reshape(n, 1).view(np.uint8), pack_codes(idx, bits)], axis=1)


def decode_key(rec: np.ndarray, bits: int, head_dim: int, layer: int, seed: int = 0) -> np.ndarray:
    """float32[n, D] reconstruction of key records."""
    g = rec[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    idx = unpack_codes(rec[:, 2:], bits, head_dim)
    c = lloyd_max_centroids(bits)[idx]
    scale = g / np.sqrt(tree_sum(c * c) * np.float32(head_dim))
    return (fwht(c) * scale[:, None]) * rotation_signs(head_dim, layer, seed)


def encode_value(w: np.ndarray, bits: int) -> np.ndarray | RawReason:
    levels = np.float32((1 << bits) - 1)
    lo = w.min(axis=1)
    lo16 = _fp16_or_none(lo)
    sc16 = _fp16_or_none((w.max(axis=1) - lo) / levels)
    if lo16 is None or sc16 is None:
        return RawReason.OUT_OF_RANGE
    lo32, sc32 = lo16.astype(np.float32)[:, None], sc16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sc32 > 0, np.rint((w - lo32) / sc32), np.float32(0))
    idx = np.clip(t, 0, levels).astype(np.uint8)
    side = np.stack([lo16, sc16], axis=1).view(np.uint8)
    return np.concatenate([side, pack_codes(idx, bits)], axis=1)


def decode_value(rec: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    side = rec[:, :4].copy().view(np.float16).astype(np.float32)
    idx = unpack_codes(rec[:, 4:], bits, head_dim).astype(np.float32)
    return side[:, 0:1] + idx * side[:, 1:2]


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
        return w.astype(header.dtype).reshape(-1)
