"""The keep-or-raw policy: each raw reason, and raw segments always decode to the exact input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.codecs import CODEC_NAMES, decode_segment, encode_segment, get_codec
from orbitkv_fs.errors import CodecError
from orbitkv_fs.segment import MAX_SOURCE_BYTES, Format, RawReason, Role, parse_header

BF16 = np.dtype(ml_dtypes.bfloat16)


def kv(n: int, d: int = 128, dtype=BF16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(dtype)


def encode_raw(x: np.ndarray, codec: str, **kw) -> RawReason:
    blob = encode_segment(x, codec, **kw)
    h = parse_header(blob)
    assert h.format == Format.RAW
    y = decode_segment(blob)
    assert y.dtype == x.dtype and y.tobytes() == np.ascontiguousarray(x).tobytes()
    return h.raw_reason


@pytest.mark.parametrize("codec", ["fp8", "turboquant-3", "turboquant-4"])
def test_over_16_mib_stays_raw(codec):
    x = np.zeros((MAX_SOURCE_BYTES // 256 + 1, 128), dtype=BF16)
    assert x.nbytes > MAX_SOURCE_BYTES
    assert encode_raw(x, codec, role="key") == RawReason.TOO_LARGE


def test_exactly_16_mib_is_encoded():
    x = kv(MAX_SOURCE_BYTES // 256)
    assert parse_header(encode_segment(x, "fp8")).format == Format.FP8


def test_over_32_mib_is_refused():
    with pytest.raises(CodecError):
        encode_segment(np.zeros(32 * 2**20 + 1, dtype=np.uint8), "none")


@pytest.mark.parametrize("codec,role", [("fp8", "opaque"), ("turboquant-4", "key"), ("turboquant-3", "value")])
def test_small_segments_not_worth_encoding_stay_raw(codec, role):
    # one vector: header + payload fits one 512-byte block either way
    assert encode_raw(kv(1), codec, role=role) == RawReason.NOT_SMALLER


def test_fp8_just_below_the_saving_threshold_stays_raw():
    # raw: 64 + 1792 -> 2048 aligned; fp8: 64 + 896 -> 1024: kept. raw 64 + 448 -> 512 vs 512: raw.
    assert parse_header(encode_segment(np.ones(896, BF16), "fp8")).format == Format.FP8
    assert encode_raw(np.ones(224, BF16), "fp8") == RawReason.NOT_SMALLER


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("codec", ["fp8", "turboquant-4"])
def test_nonfinite_stays_raw(codec, bad):
    x = kv(64)
    x[17, 3] = bad
    assert encode_raw(x, codec, role="key") == RawReason.NONFINITE


@pytest.mark.parametrize("big", [450.0, -464.0, 1e4, 3e38])
def test_fp8_out_of_range_stays_raw_never_clipped(big):
    x = kv(64)
    x[-1, -1] = big
    assert encode_raw(x, "fp8") == RawReason.OUT_OF_RANGE


def test_turboquant_norm_outside_fp16_stays_raw():
    x = np.full((64, 128), 6000.0, dtype=BF16)  # norm 67,882 > 65,504
    assert encode_raw(x, "turboquant-4", role="key") == RawReason.OUT_OF_RANGE
    x = np.zeros((64, 128), dtype=BF16)
    x[0, 0], x[0, 1] = -70000.0, 0.0
    assert encode_raw(x, "turboquant-4", role="value") == RawReason.OUT_OF_RANGE


@pytest.mark.parametrize("d", [16, 48, 96, 512])
def test_turboquant_unsupported_head_dim_stays_raw(d):
    assert encode_raw(kv(64, d), "turboquant-4", role="key") == RawReason.UNSUPPORTED


@pytest.mark.parametrize("codec", ["fp8", "turboquant-3"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int16])
def test_unsupported_dtype_stays_raw(codec, dtype):
    assert encode_raw((np.arange(64 * 128) % 5).astype(dtype).reshape(64, 128), codec, role="key") == RawReason.UNSUPPORTED


def test_turboquant_needs_a_role():
    assert encode_raw(kv(64), "turboquant-4", role="opaque") == RawReason.UNSUPPORTED


def test_none_keeps_everything_with_no_reason():
    x = kv(64)
    assert encode_raw(x, "none", role="value", layer=65535) == RawReason.NONE


def test_bad_arguments_are_typed_errors():
    with pytest.raises(CodecError):
        encode_segment(kv(4), "zstd")
    with pytest.raises(CodecError):
        encode_segment(kv(4), "fp8", layer=70000)
    with pytest.raises(CodecError):
        encode_segment(kv(4), "fp8", role="query")
    with pytest.raises(CodecError):
        get_codec("fp16")


def test_codec_names_and_config():
    assert CODEC_NAMES == ("none", "ans", "fp8", "turboquant-4", "turboquant-3")
    c = get_codec("turboquant-3", seed=5)
    assert c.get_config() == {"id": "turboquant-3", "bits": 3, "seed": 5}
    assert type(c).from_config(c.get_config()).get_config() == c.get_config()
    assert Role.parse("k") == Role.KEY and Role.parse("V") == Role.VALUE
