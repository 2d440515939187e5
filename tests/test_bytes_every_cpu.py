"""Bytes are a function of the input alone (DESIGN.md invariant 8), whatever the CPU: the golden segments
(tests/golden_segments.py: TurboQuant 3/4-bit K and V at head dims 32-256, FP8 of BF16 and FP16) are
encoded in subprocesses under every numpy SIMD dispatch level this machine allows
(``NPY_DISABLE_CPU_FEATURES``, from the top level down to the baseline) and every numba target it can run
(``NUMBA_CPU_NAME``: the x86-64 micro-architecture levels up to the host's, and ``generic``), and every run
must give the pinned digests. On a GPU machine, tests/test_gpu_engine.py holds the GPU to the same digests.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import golden_segments
import pytest
from numpy._core import _multiarray_umath as _umath

HERE = os.path.dirname(os.path.abspath(__file__))


def numpy_levels() -> list[str]:
    """Values of NPY_DISABLE_CPU_FEATURES: none, then the dispatch targets found here, disabled top down."""
    found = [f for f in _umath.__cpu_dispatch__ if _umath.__cpu_features__.get(f)]
    return [" ".join(found[len(found) - k:]) for k in range(len(found) + 1)]


def numba_targets() -> list[str]:
    """LLVM CPU names the host can execute: generic, then x86-64 levels up to what the CPU has."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["generic"]
    f = _umath.__cpu_features__
    levels = {"x86-64": True,
              "x86-64-v2": f.get("SSE42", False) and f.get("POPCNT", False),
              "x86-64-v3": f.get("AVX2", False) and f.get("FMA3", False) and f.get("BMI2", False),
              "x86-64-v4": all(f.get(k, False) for k in ("AVX512F", "AVX512BW", "AVX512CD", "AVX512DQ", "AVX512VL"))}
    return ["generic"] + [name for name, ok in levels.items() if ok]


def run_child(env: dict[str, str], tmp_path) -> dict:
    env = {**os.environ, **env, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    out = subprocess.run([sys.executable, os.path.join(HERE, "golden_segments.py")], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_levels_cover_this_machine():
    """The sweep is not vacuous: at least the unmodified run and, on x86-64, the baseline numba target."""
    assert numpy_levels()[0] == ""
    assert "generic" in numba_targets()


@pytest.mark.parametrize("disabled", numpy_levels(), ids=lambda s: "numpy:" + (s.split()[0] if s else "all"))
def test_golden_digests_under_numpy_dispatch_level(disabled, tmp_path):
    assert run_child({"NPY_DISABLE_CPU_FEATURES": disabled}, tmp_path) == golden_segments.PINNED


@pytest.mark.parametrize("cpu", numba_targets())
def test_golden_digests_under_numba_target(cpu, tmp_path):
    lowest = numpy_levels()[-1]
    assert run_child({"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NPY_DISABLE_CPU_FEATURES": lowest},
                     tmp_path) == golden_segments.PINNED
