"""``fp8``: BF16/FP16 -> E4M3FN, round-to-nearest ties-to-even, on the CPU. Lossy, experimental.

Owns the host reference of the FP8 format that the GPU kernels must reproduce byte for byte:

* E4M3FN: bias 7, no infinities, 0x7F/0xFF are NaN, largest finite 448 (0x7E), subnormals down to
  2**-9; signed zero is kept (-0.0 -> 0x80); values under half the smallest subnormal round to zero.
* A segment holding any NaN/infinity, or any finite |x| > 448, is declined (stored raw): never clipped.
* Decode is exact: every E4M3FN value is representable in BF16 and FP16, and decodes to the source dtype.

Both directions are table lookups (65,536 entries in, 256 out) run by numba, one pass, no temporaries.
The tables are computed arithmetically here; the tests check them against ml_dtypes independently.
"""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np

from ..segment import RawReason, SegmentHeader
from .base import Codec, Declined, Encoded

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP8_MAX = 448.0
_REJECT_NONFINITE = 0x200
_REJECT_RANGE = 0x100


def _source_values(dtype: np.dtype) -> np.ndarray:
    bits = np.arange(1 << 16, dtype=np.uint16)
    if dtype == BF16:
        with np.errstate(invalid="ignore"):  # signalling-NaN patterns warn on the widening cast
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _encode_table(dtype: np.dtype) -> np.ndarray:
    """uint16[65536]: low byte the E4M3FN code, 0x100 out of range, 0x200 nonfinite."""
    x = _source_values(dtype)
    table = np.zeros(1 << 16, dtype=np.uint16)
    finite = np.isfinite(x)
    a = np.where(finite, np.abs(x), 0.0)
    sign = np.signbit(x).astype(np.uint16) << 7
    _, e2 = np.frexp(a)  # a = m * 2**e2 with m in [0.5, 1): floor(log2 a) = e2 - 1
    e = np.maximum(e2 - 1, -6)
    r = np.rint(a / np.exp2(e - 3.0))  # in [0, 16]; exact in float64, rint ties to even
    code = ((e + 6) << 3) + r.astype(np.int64)
    code = np.where(a == 0, 0, code)
    table[:] = sign | np.where(a <= FP8_MAX, code, 0).astype(np.uint16)
    table[finite & (a > FP8_MAX)] |= _REJECT_RANGE
    table[~finite] |= _REJECT_NONFINITE
    return table


def _decode_table(dtype: np.dtype) -> np.ndarray:
    """uint16[256]: the source-dtype bits of each E4M3FN code (NaN codes map to the dtype's NaN)."""
    codes = np.arange(256, dtype=np.uint8)
    mag = codes & 0x7F
    exp = (mag >> 3).astype(np.int64)
    man = (mag & 7).astype(np.float64)
    val = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * np.exp2(exp - 7.0))
    val = np.where(mag == 0x7F, np.nan, val)
    val = np.where(codes & 0x80, -val, val)
    return val.astype(np.float32).astype(dtype).view(np.uint16)


_ENC = {BF16: _encode_table(BF16), FP16: _encode_table(FP16)}
_DEC = {BF16: _decode_table(BF16), FP16: _decode_table(FP16)}


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _encode_kernel(src: np.ndarray, table: np.ndarray, out: np.ndarray) -> int:
    flags = 0
    for i in range(src.size):
        v = table[src[i]]
        out[i] = v & 0xFF
        flags |= v
    return flags >> 8


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _decode_kernel(src: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.size):
        out[i] = table[src[i]]


def encode_fp8(x: np.ndarray) -> np.ndarray | RawReason:
    """E4M3FN codes of BF16/FP16 ``x`` (flat uint8), or the reason the array must stay raw."""
    dtype = np.dtype(x.dtype)
    if dtype not in _ENC:
        return RawReason.UNSUPPORTED
    src = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
    out = np.empty(src.size, dtype=np.uint8)
    flags = _encode_kernel(src, _ENC[dtype], out)
    if flags & (_REJECT_NONFINITE >> 8):
        return RawReason.NONFINITE
    if flags & (_REJECT_RANGE >> 8):
        return RawReason.OUT_OF_RANGE
    return out


def decode_fp8(codes: "np.ndarray | memoryview", dtype: np.dtype) -> np.ndarray:
    """Flat array of ``dtype`` (BF16 or FP16) holding the exact values of the E4M3FN ``codes``."""
    src = np.frombuffer(codes, dtype=np.uint8) if not isinstance(codes, np.ndarray) else codes.reshape(-1)
    out = np.empty(src.size, dtype=np.uint16)
    _decode_kernel(src, _DEC[np.dtype(dtype)], out)
    return out.view(dtype)


class Fp8Codec(Codec):
    codec_id = "fp8"
    exact = False

    def encode(self, x: np.ndarray, *, role, layer) -> Encoded | Declined:  # noqa: ARG002
        res = encode_fp8(x)
        if isinstance(res, RawReason):
            return Declined(res, f"fp8 declines {x.dtype} input ({res.name.lower()})")
        return Encoded(payload=res, bits=8)

    def decode(self, header: SegmentHeader, payload: memoryview) -> np.ndarray:
        return decode_fp8(payload, header.dtype)
