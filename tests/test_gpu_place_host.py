"""Where the GPU engine's worker puts a new batch in its workspace (``Worker.place``), with no CUDA behind it:
two consecutive batches that fit in the workspace together run side by side (the new one never waits for the
one in flight), whatever their sizes; placed batches never overlap the one in flight nor pass the workspace's
end; a pair that does not fit finishes the older batch first and grows the workspace for the next such pair.
Needs cupy (the engine module imports it), not a GPU."""

from __future__ import annotations

import random
import types
from collections import Counter

import pytest

pytest.importorskip("cupy")

from orbitkv_fs.gpu import engine as E  # noqa: E402

MIB = 1 << 20


class _Workspace:
    def __init__(self, size: int, budget: int) -> None:
        self.ptr, self.size, self.budget, self.grows = 1 << 40, size, budget, 0

    def reserve(self, nbytes: int) -> int:
        if nbytes > self.size:
            self.size, self.grows = min(self.budget, max(nbytes, 2 * self.size)), self.grows + 1
        return self.ptr


def _worker(size: int, budget: int) -> "E.Worker":
    w = E.Worker.__new__(E.Worker)
    w.ws, w.inflight, w.stats = _Workspace(size, budget), [], Counter()
    w.uploads, w._spare_events = (object(), object()), []
    return w


def _run(w: "E.Worker", sizes: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """Place ``sizes`` as the pipelines do (batch i+1 placed, then batch i finished); answers how many batches
    had to wait for the one before (finished inside ``place``) and each batch's extent."""
    waited, extents = 0, []
    event = types.SimpleNamespace(synchronize=lambda: None)
    for n in sizes:
        before = list(w.inflight)
        base, upload = w.place(n)
        waited += sum(f not in w.inflight for f in before)
        start = base - w.ws.ptr
        assert 0 <= start and start + n <= w.ws.size, (start, n, w.ws.size)
        for f in w.inflight:  # the batch still in flight
            assert start + n <= f.start or f.end <= start, ((start, n), (f.start, f.end))
            assert upload is not w.uploads[f.upload]
        w.inflight.append(E._Flight(start, start + n, w.uploads.index(upload), event, lambda: None))
        extents.append((start, start + n))
        if len(w.inflight) > 1:
            w.finish(w.inflight[0])
    return waited, extents


@pytest.mark.parametrize("seed", range(4))
def test_consecutive_batches_that_fit_together_run_side_by_side(seed):
    rng = random.Random(seed)
    size = 256 * MIB
    ramp = [size // 8, size // 4, size // 2 - MIB, size // 2 - MIB, size // 2 - MIB, size // 5, size // 9]
    assert _run(_worker(size, size), ramp)[0] == 0  # a request ramping up and down
    for _ in range(50):
        sizes = [rng.randrange(1, size // 2) for _ in range(rng.randrange(2, 30))]
        waited, _ = _run(_worker(size, size), sizes)
        assert waited == 0, sizes


def test_a_pair_too_large_waits_once_then_grows_for_the_next_pair():
    w = _worker(16 * MIB, 256 * MIB)
    waited, _ = _run(w, [12 * MIB, 12 * MIB, 12 * MIB, 12 * MIB])
    assert waited == 1 and w.ws.grows == 1 and w.ws.size >= 24 * MIB
    w = _worker(16 * MIB, 16 * MIB)  # no room to grow: every batch waits for the one before
    waited, _ = _run(w, [12 * MIB] * 4)
    assert waited == 3 and w.ws.grows == 0
