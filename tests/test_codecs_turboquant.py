"""TurboQuant: record sizes, determinism (runs and processes), pinned bytes, and quality figures.

Quality is relative MSE ||x - x^||^2 / ||x||^2 over all vectors. K must meet the Lloyd-Max scalar bound
of N(0, 1): 0.0345 at 3 bits, 0.0095 at 4 bits, on Gaussian vectors and on real SmolLM2-135M keys; V
figures are printed, not asserted (per-vector uniform quantisation has no such bound).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import golden_segments
import numpy as np
import pytest
from golden_segments import BF16, HEAD_DIMS, golden_input

from orbitkv_fs.codecs import decode_segment, encode_segment
from orbitkv_fs.codecs.turboquant import lloyd_max_boundaries, lloyd_max_centroids, rotation_signs
from orbitkv_fs.segment import Format, Role, parse_header, turboquant_record_bytes

K_TARGET = {3: 0.0345, 4: 0.0095}


def rel_mse(x: np.ndarray, y: np.ndarray) -> float:
    xf = x.astype(np.float64).reshape(-1)
    yf = y.astype(np.float64).reshape(-1)
    return float(((xf - yf) ** 2).sum() / (xf**2).sum())


def all_digests() -> dict[str, str]:
    return golden_segments.turboquant_digests()


@pytest.mark.parametrize("bits,role,size", [(4, "key", 66), (4, "value", 68), (3, "key", 50), (3, "value", 52)])
def test_record_sizes_at_head_dim_128(bits, role, size):
    assert turboquant_record_bytes(128, bits, Role.parse(role)) == size
    blob = encode_segment(golden_input(128), f"turboquant-{bits}", role=role)
    h = parse_header(blob)
    assert (h.format, h.bits, h.head_dim, h.sign_version) == (Format.TURBOQUANT, bits, 128, 1)
    assert h.stored_length == 256 * size


def test_deterministic_within_a_process():
    assert all_digests() == all_digests()


def test_deterministic_across_processes():
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_codecs_turboquant as t; "
            "print(json.dumps(t.all_digests()))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == all_digests()


def test_pinned_bytes():
    assert golden_segments.input_digests() == golden_segments.INPUTS, "the golden inputs changed, not the codec"
    assert all_digests() == golden_segments.TURBOQUANT


F32 = np.float32


def _tree_sum_ref(v: list) -> "np.float32":
    while len(v) > 1:
        h = len(v) // 2
        v = [F32(v[i] + v[i + h]) for i in range(h)]
    return v[0]


def _fwht_ref(v: list) -> list:
    v, h = list(v), 1
    while h < len(v):
        for i in range(0, len(v), 2 * h):
            for j in range(i, i + h):
                v[j], v[j + h] = F32(v[j] + v[j + h]), F32(v[j] - v[j + h])
        h *= 2
    return v


def _pack_ref(idx: list, bits: int) -> bytes:
    acc = sum(int(c) << (j * bits) for j, c in enumerate(idx))
    return acc.to_bytes(len(idx) * bits // 8, "little")


def encode_vector_ref(x: np.ndarray, bits: int, role: str, layer: int, seed: int = 0) -> bytes:
    """One record, scalar float32 ops in the order docs/format.md specifies: an independent check."""
    w = [F32(v) for v in x.astype(np.float32)]
    d = len(w)
    if role == "value":
        levels = F32((1 << bits) - 1)
        lo = min(w)
        lo16 = np.float16(lo)
        sc16 = np.float16(F32(F32(max(w) - lo) / levels))
        lo32, sc32 = F32(lo16), F32(sc16)
        idx = [int(min(max(np.rint(F32(F32(v - lo32) / sc32)), 0), levels)) if sc32 > 0 else 0 for v in w]
        return lo16.tobytes() + sc16.tobytes() + _pack_ref(idx, bits)
    signs = rotation_signs(d, layer, seed)
    norm = np.sqrt(_tree_sum_ref([F32(v * v) for v in w]))
    z = _fwht_ref([F32(v * s) for v, s in zip(w, signs)])
    q = [F32(v / norm) if norm > 0 else F32(0) for v in z]
    bnd, cen = lloyd_max_boundaries(bits), lloyd_max_centroids(bits)
    idx = [int(sum(v > b for b in bnd)) for v in q]
    c = [cen[i] for i in idx]
    den = np.sqrt(F32(_tree_sum_ref([F32(v * v) for v in c]) * F32(d)))
    g = F32(F32(norm * _tree_sum_ref([F32(a * b) for a, b in zip(q, c)])) / den)
    return np.float16(g).tobytes() + _pack_ref(idx, bits)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("role", ["key", "value"])
def test_bytes_match_a_scalar_reference_of_the_spec(d, bits, role):
    x = golden_input(d)[:24] * np.float32(3)
    x[5] = 0
    blob = encode_segment(x.astype(BF16), f"turboquant-{bits}", role=role, layer=11)
    ref = b"".join(encode_vector_ref(v, bits, role, 11) for v in x.astype(BF16))
    assert bytes(blob[64:]) == ref


def test_key_bytes_match_the_reference_where_squares_are_subnormal():
    """BF16 keys below 2^-63 have subnormal float32 squares: the host keeps IEEE gradual underflow, as the
    format specifies (and the GPU kernels, built with -ftz=false: tests/test_gpu_engine.py)."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal((4, 64)).astype(np.float32) * np.float32(2.0 ** e)
                        for e in (-75, -70, -66, -64, -60)]).astype(BF16)
    blob = encode_segment(x, "turboquant-4", role="key", layer=2)
    assert parse_header(bytes(blob[:64])).format == Format.TURBOQUANT
    assert bytes(blob[64:]) == b"".join(encode_vector_ref(v, 4, "key", 2) for v in x)


def test_layer_and_seed_change_the_signs_only_as_specified():
    s = rotation_signs(128, 3)
    assert set(np.unique(s)) == {-1.0, 1.0} and s.dtype == np.float32
    assert not np.array_equal(s, rotation_signs(128, 4))
    assert not np.array_equal(s, rotation_signs(128, 3, seed=1))
    assert np.array_equal(rotation_signs(64, 3), s[:64])  # sign j does not depend on head_dim


def test_sign_generator_matches_scalar_splitmix64():
    m = (1 << 64) - 1

    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    for seed, layer in [(0, 0), (0, 29), (0xFFFFFFFF, 65535), (7, 1)]:
        ref = [-1.0 if splitmix64(((seed << 32) | (layer << 16) | j) ^ 0x4F524249544B5631) >> 63 else 1.0
               for j in range(256)]
        assert rotation_signs(256, layer, seed).tolist() == ref


@pytest.mark.parametrize("bits,mse", [(3, 0.034548), (4, 0.009501)])
def test_lloyd_max_tables_are_the_gaussian_optimum(bits, mse):
    c = lloyd_max_centroids(bits).astype(np.float64)
    b = lloyd_max_boundaries(bits).astype(np.float64)
    assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1]) and np.all((c[:-1] < b) & (b < c[1:]))
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    edges = [-math.inf, *b, math.inf]
    total = 0.0
    for i, ci in enumerate(c):
        lo, hi = edges[i], edges[i + 1]
        p = cdf(hi) - cdf(lo)
        pl, ph = (pdf(lo) if lo != -math.inf else 0.0), (pdf(hi) if hi != math.inf else 0.0)
        mean = (pl - ph) / p  # centroid condition: each level is its cell's conditional mean
        assert abs(mean - ci) < 1e-6
        lo_t = lo * pl if lo != -math.inf else 0.0
        hi_t = hi * ph if hi != math.inf else 0.0
        second = p + lo_t - hi_t  # E[x^2; cell]
        total += second - 2 * ci * (pl - ph) + ci * ci * p
    assert abs(total - mse) < 2e-6


def test_zero_and_constant_vectors():
    x = np.zeros((64, 128), dtype=BF16)
    x[1::2] = 1.5
    for role in ("key", "value"):
        y = decode_segment(encode_segment(x, "turboquant-4", role=role)).reshape(x.shape)
        assert np.all(y[::2] == 0)
    y = decode_segment(encode_segment(x, "turboquant-3", role="value")).reshape(x.shape)
    assert np.array_equal(y, x)  # constant vectors are exact under V's min/scale


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gaussian_relative_mse(d, capsys):
    x = np.random.default_rng(d).standard_normal((32768 // d * 16, d)).astype(BF16)
    figures = {}
    for bits in (3, 4):
        for role in ("key", "value"):
            blob = encode_segment(x, f"turboquant-{bits}", role=role, layer=d)
            assert parse_header(blob).format == Format.TURBOQUANT
            figures[(bits, role)] = rel_mse(x, decode_segment(blob))
    with capsys.disabled():
        print(f"\n[turboquant gaussian D={d}] " + "  ".join(f"{r[0].upper()}{b}={v:.5f}" for (b, r), v in figures.items()))
    for bits in (3, 4):
        assert figures[(bits, "key")] <= K_TARGET[bits]


@pytest.mark.e2e
def test_smollm2_relative_mse(capsys):
    from orbitkv_fs.tools.models import ModelUnavailable, prefill_kv

    try:
        kv = prefill_kv()
    except ModelUnavailable as e:  # a machine without the model package (CI installs it): say what is missing
        pytest.skip(str(e))
    assert len(kv) == 30 and kv[0][0].shape[1:] == (3, 64) and kv[0][0].dtype == BF16
    lines = []
    for bits in (3, 4):
        for ri, role in enumerate(("key", "value")):
            err = ref = 0.0
            worst = 0.0
            for layer, pair in enumerate(kv):
                x = pair[ri]
                blob = encode_segment(x, f"turboquant-{bits}", role=role, layer=layer)
                assert parse_header(blob).format == Format.TURBOQUANT
                xf = x.astype(np.float64).reshape(-1)
                e = float(((xf - decode_segment(blob).astype(np.float64)) ** 2).sum())
                err, ref, worst = err + e, ref + float((xf**2).sum()), max(worst, e / float((xf**2).sum()))
            lines.append(f"{role[0].upper()}{bits}: {err / ref:.5f} (worst layer {worst:.5f})")
            if role == "key":
                assert err / ref <= K_TARGET[bits]
    with capsys.disabled():
        print(f"\n[turboquant SmolLM2-135M, {kv[0][0].shape[0]} tokens x 30 layers] " + "  ".join(lines))
