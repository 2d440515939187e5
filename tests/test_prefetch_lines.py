"""orbitkv_fs.prefetch: a hint that changes no byte and never faults, compiled to the CPU's prefetch
instructions (for reading, and for writing where the CPU has one)."""

from __future__ import annotations

import platform

import numba
import numpy as np
import pytest

from orbitkv_fs.prefetch import prefetch_lines


@numba.njit(cache=False)
def _sum_after_prefetch(buf: np.ndarray, at: np.ndarray, write: bool) -> int:
    prefetch_lines(buf.ctypes.data, at, write)
    total = 0
    for j in range(at.shape[0]):
        total += buf[at[j]]
    return total


@pytest.mark.parametrize("write", [False, True])
def test_prefetch_changes_nothing_and_does_not_fault(write):
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    before = buf.copy()
    at = rng.integers(0, buf.size, size=500).astype(np.int64)
    assert _sum_after_prefetch(buf, at, write) == int(buf[at].astype(np.int64).sum())
    assert (buf == before).all()
    # addresses far outside the buffer (and null): a prefetch never faults
    _wild(buf.ctypes.data, np.array([-buf.ctypes.data, 1 << 46, -(1 << 40)], np.int64), write)


@numba.njit(cache=False)
def _wild(base: int, at: np.ndarray, write: bool) -> None:
    prefetch_lines(base, at, write)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's prefetch instructions")
def test_prefetch_compiles_to_prefetch_instructions():  # cache=False: the assembly is there to inspect
    at = np.zeros(1, np.int64)
    buf = np.zeros(64, np.uint8)
    _sum_after_prefetch(buf, at, True)
    asm = "\n".join(_sum_after_prefetch.inspect_asm().values()).lower()
    assert "prefetcht0" in asm or "prefetchw" in asm
