"""DRAM's part of one page of the admin listing (`GET /v1/objects?limit=1`, the README's example) with N
objects cached (16 segments a chunk): the tree's `DramTier.listing` as its Manager calls it, all rows (base)
or the page's (new, with its limit). Median of 5 calls; the rows are built under the DRAM lock.

Usage: PYTHONPATH=<tree> python listing_cost.py OBJECTS..."""

from __future__ import annotations

import inspect
import statistics
import sys
import time

from filled import filled_tier


def main() -> None:
    for n in map(int, sys.argv[1:]):
        t = filled_tier(n)
        try:
            paged = "limit" in inspect.signature(t.listing).parameters
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                rows = t.listing(lambda p: p[:16] == b"n" * 16, after=b"", limit=2) if paged else t.listing()
                times.append(time.perf_counter() - t0)
                assert len(rows) >= 2
            print(f"{n:>8} objects: a page's DRAM listing {statistics.median(times) * 1e3:.1f} ms")
        finally:
            t.close()


if __name__ == "__main__":
    main()
