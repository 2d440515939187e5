"""Golden inputs and the digests of their segments: the byte format's test vectors.

The inputs are built so that nothing machine- or version-dependent reaches their bytes: the normals are
drawn as float64 (numpy's PCG64 and ziggurat), rounded to float32 by numpy (one IEEE rounding) and to
BF16/FP16 by integer arithmetic here, never by a library's float64 conversion. ml_dtypes 0.7 rounds
float64 straight to BF16 where earlier releases went through float32 (two roundings): one element of
these inputs differs between the two, which moved four TurboQuant K digests and made the pinned-bytes
test's verdict depend on the machine's ml_dtypes. ``INPUT_DIGESTS`` pins the inputs themselves, so a
drift of the input generator says so instead of looking like an encoder change.

Run as a script, it prints ``{"digests": ..., "inputs": ...}`` as JSON (the every-CPU test runs it in
subprocesses under each SIMD dispatch level and numba target).
"""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
HEAD_DIMS = (32, 64, 128, 256)
TOKENS = 256


def bf16_from_f32(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> BF16 on the bits (inputs are finite)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return r.astype(np.uint16).view(BF16)


def golden_input(d: int, dtype: np.dtype = BF16) -> np.ndarray:
    """``TOKENS`` x ``d`` standard normals, as BF16 (or FP16: numpy's float32 -> float16 is one rounding)."""
    f32 = np.random.default_rng(2026).standard_normal((TOKENS, d)).astype(np.float32)
    return bf16_from_f32(f32) if np.dtype(dtype) == BF16 else f32.astype(FP16)


def _sha(b: "bytes | np.ndarray") -> str:
    return hashlib.sha256(bytes(b) if not isinstance(b, np.ndarray) else b.tobytes()).hexdigest()[:16]


def input_digests() -> dict[str, str]:
    return {f"{d}/{np.dtype(t).name}": _sha(golden_input(d, t)) for d in HEAD_DIMS for t in (BF16, FP16)}


def turboquant_digests() -> dict[str, str]:
    from orbitkv_fs.codecs import encode_segment

    return {f"{d}/{bits}/{role}": _sha(encode_segment(golden_input(d), f"turboquant-{bits}", role=role, layer=3))
            for d in HEAD_DIMS for bits in (3, 4) for role in ("key", "value")}


def fp8_digests() -> dict[str, str]:
    from orbitkv_fs.codecs import encode_segment

    return {f"{d}/{np.dtype(t).name}": _sha(encode_segment(golden_input(d, t), "fp8", role="key", layer=3))
            for d in (64, 128) for t in (BF16, FP16)}


# sha256 prefixes of the segments of golden_input(D) at layer 3, seed 0. They pin the byte format:
# a change here is a format change (and the GPU kernels must follow it).
TURBOQUANT = {
    "32/3/key": "0fde08d3520dfcc5",
    "32/3/value": "691c1638c03cdcce",
    "32/4/key": "14714ba9d3eab305",
    "32/4/value": "cb740dfce77f97a4",
    "64/3/key": "8f79b295a6956062",
    "64/3/value": "54727001d17b1e03",
    "64/4/key": "17ed7c9425bbc773",
    "64/4/value": "4b3671dcd9027dba",
    "128/3/key": "756f9aa64f71a951",
    "128/3/value": "b2e682ac9283957d",
    "128/4/key": "89084ed2f2626c07",
    "128/4/value": "aa78a4c37d2b6fbc",
    "256/3/key": "99749344c134860b",
    "256/3/value": "122887df65b22c40",
    "256/4/key": "1fcd657acfa0349f",
    "256/4/value": "a475d181eef11af2",
}

# The FP8 segments of golden_input(D, dtype) (role key, layer 3).
FP8 = {
    "64/bfloat16": "9eb9a1330166f53b",
    "64/float16": "583f5b15c37e91d4",
    "128/bfloat16": "b8381fcf611eca7d",
    "128/float16": "596d80c0e52fd0e1",
}

# The inputs themselves (their bytes, before any codec).
INPUTS = {
    "32/bfloat16": "1fd576f38061104a",
    "32/float16": "69c87402ee7fef06",
    "64/bfloat16": "923a3bf98c5a7aac",
    "64/float16": "980c56893e0b01b9",
    "128/bfloat16": "a799350ff524e307",
    "128/float16": "befbba7317e44c39",
    "256/bfloat16": "f4501bc985b0977f",
    "256/float16": "e9f00ba2d7c69a7e",
}


def all_digests() -> dict[str, dict[str, str]]:
    return {"inputs": input_digests(), "turboquant": turboquant_digests(), "fp8": fp8_digests()}


PINNED = {"inputs": INPUTS, "turboquant": TURBOQUANT, "fp8": FP8}

if __name__ == "__main__":
    print(json.dumps(all_digests()))
