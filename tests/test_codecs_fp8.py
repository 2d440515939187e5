"""FP8 (E4M3FN) against ml_dtypes, the independent reference, for every BF16 and FP16 bit pattern."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.codecs import decode_segment, encode_segment
from orbitkv_fs.codecs.fp8 import decode_fp8, encode_fp8
from orbitkv_fs.segment import Format, RawReason, parse_header

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def all_patterns(dtype: np.dtype) -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def split(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    x = all_patterns(dtype)
    with np.errstate(invalid="ignore"):  # NaN payloads
        f = x.astype(np.float64)
    ok = np.isfinite(f) & (np.abs(f) <= 448)
    return x[ok], x[~ok]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_every_in_range_pattern_matches_ml_dtypes(dtype):
    good, _ = split(dtype)
    assert good.size > 30000
    codes = encode_fp8(good)
    assert isinstance(codes, np.ndarray) and codes.dtype == np.uint8
    ref = good.astype(E4M3).view(np.uint8)
    bad = np.flatnonzero(codes != ref)
    assert bad.size == 0, [(hex(good.view(np.uint16)[i]), hex(codes[i]), hex(ref[i])) for i in bad[:8]]
    back = decode_fp8(codes, dtype)
    assert back.dtype == dtype
    assert np.array_equal(back.view(np.uint16), ref.view(E4M3).astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_every_out_of_range_or_nonfinite_pattern_stays_raw(dtype):
    _, rest = split(dtype)
    with np.errstate(invalid="ignore"):
        f = rest.astype(np.float64)
    assert rest.size > 1000 and np.isnan(f).any() and np.isinf(f).any()
    filler = np.zeros(7, dtype=dtype)  # a reject anywhere in the segment, not only alone
    for v, fv in zip(rest, f):
        got = encode_fp8(np.concatenate([filler, np.array([v], dtype=dtype)]))
        assert got == (RawReason.OUT_OF_RANGE if np.isfinite(fv) else RawReason.NONFINITE), hex(v.view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_segment_round_trip_of_every_in_range_pattern(dtype):
    good, _ = split(dtype)
    blob = encode_segment(good, "fp8", role="value", layer=5)
    h = parse_header(blob)
    assert h.format == Format.FP8 and h.stored_length * 2 == good.nbytes and h.dtype == dtype
    y = decode_segment(blob)
    assert y.dtype == dtype
    assert np.array_equal(y.view(np.uint16), good.astype(E4M3).astype(dtype).view(np.uint16))
    # decode is exact: the decoded values are E4M3 values, and encoding them again changes nothing
    assert decode_segment(encode_segment(y, "fp8")).tobytes() == y.tobytes()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_decode_of_every_code(dtype):
    codes = np.arange(256, dtype=np.uint8)
    got = decode_fp8(codes, dtype).astype(np.float64)
    ref = codes.view(E4M3).astype(np.float64)
    nan = np.isnan(ref)
    assert np.array_equal(np.flatnonzero(nan), [0x7F, 0xFF]) and np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan], ref[~nan])
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(ref[~nan]))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_signed_zero_subnormals_and_ties(dtype):
    vals = [0.0, -0.0, 2.0**-9, -(2.0**-9), 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 7 * 2.0**-9, 2.0**-6,
            2.0**-11, 448.0, -448.0, 17.0, 19.0, 240.0, 232.0]
    expect = [0x00, 0x80, 0x01, 0x81, 0x00, 0x02, 0x02, 0x07, 0x08, 0x00, 0x7E, 0xFE, 0x58, 0x5A, 0x77, 0x76]
    codes = encode_fp8(np.array(vals, dtype=dtype))
    assert [int(c) for c in codes] == expect
    back = decode_fp8(codes, dtype)
    assert np.signbit(back[1]) and not np.signbit(back[0]) and back[1] == 0
    assert back[2] == 2.0**-9 and back[7] == 7 * 2.0**-9


def test_multidimensional_input_decodes_flat_in_c_order():
    x = (np.arange(24 * 256, dtype=np.float32).reshape(24, 256) % 17 - 8).astype(BF16)
    y = decode_segment(encode_segment(x, "fp8"))
    assert y.shape == (x.size,) and np.array_equal(y, x.reshape(-1))  # small integers are exact in E4M3
    z = decode_segment(encode_segment(np.asfortranarray(x), "fp8"))
    assert np.array_equal(z, x.reshape(-1))
