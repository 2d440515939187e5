"""The GPU worker's workspace placement policy (``orbitkv_fs.gpu.placement``, no cupy): a new batch beside the
one in flight never overlaps it, stays in the workspace and starts aligned; whenever the two fit together it is
placed (double-ended), whatever the order of their sizes; ``pair_bytes`` is what makes a pair fit. The rule it
replaced (right after the batch in flight) leaves a batch in the middle and refuses pairs that fit."""

from __future__ import annotations

import random

from orbitkv_fs.gpu.placement import ALIGN, pair_bytes, place_beside

MIB = 1 << 20


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed(size: int, start: int, end: int, nbytes: int) -> int | None:
    """The previous rule: below the batch in flight, else right after it."""
    if nbytes <= start:
        return 0
    return _up(end) if _up(end) + nbytes <= size else None


def _pipeline(place, size: int, sizes: list[int]) -> int:
    """Batches placed in turn while the one before is in flight; answers how many had to wait for it."""
    waited, flight = 0, None
    for n in sizes:
        at = place(size, *flight, n) if flight else 0
        if at is None:
            waited, at = waited + 1, 0
        else:
            assert at % ALIGN == 0 and 0 <= at and at + n <= size, (at, n, size)
            if flight:
                assert at + n <= flight[0] or flight[1] <= at, (at, n, flight)
        flight = (at, at + n)
    return waited


def test_every_pair_that_fits_is_placed_side_by_side():
    rng = random.Random(3)
    size = 256 * MIB
    for _ in range(2000):
        start = rng.randrange(0, size // ALIGN) * ALIGN
        end = rng.randrange(start + 1, size + 1)
        n = rng.randrange(1, size)
        at = place_beside(size, start, end, n)
        fits = n <= start or _up(end) + n <= size or (size - n) // ALIGN * ALIGN >= _up(end)
        assert (at is not None) == fits, (start, end, n)
        if at is not None:
            assert at % ALIGN == 0 and at + n <= size and (at + n <= start or end <= at)
    # a request's batches of any sizes, each pair fitting: none waits (the packed rule made some wait)
    seqs = [[size // 8, size // 4, size // 2 - MIB, size // 2 - MIB, size // 5]]
    seqs += [[rng.randrange(1, size // 2) for _ in range(rng.randrange(2, 30))] for _ in range(200)]
    assert all(_pipeline(place_beside, size, s) == 0 for s in seqs)
    assert sum(_pipeline(_packed, size, s) for s in seqs) > 0


def test_a_pair_too_large_fits_once_the_workspace_is_its_pair_bytes():
    for start, n in ((0, 12 * MIB), (5 * MIB, 9 * MIB), (0, 1)):
        end = start + 12 * MIB + 5
        size = end + n - 1  # one byte short
        assert place_beside(size, start, end, n) is None or n <= start
        grown = max(size, pair_bytes(start, end, n))
        assert place_beside(grown, 0, end - start, n) is not None
