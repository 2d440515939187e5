"""DRAM time under the tier's lock to invalidate one chunk (what an engine may ask for its own chunks, over
the data plane) with N objects cached (16 segments a chunk, 400-byte segments). The call is the one the
Manager makes in each tree: `invalidate_chunks` where the tier has it, else `invalidate` with the predicate
the Manager passed (which looked at every object's packed key). Median of 5 calls, each on a chunk present.

Usage: PYTHONPATH=<tree> python invalidate_cost.py CHUNKS..."""

from __future__ import annotations

import statistics
import sys
import time

from filled import PER, filled_tier


def main() -> None:
    for n_chunks in map(int, sys.argv[1:]):
        t = filled_tier(n_chunks * PER)
        try:
            times = []
            for c in range(5):
                p = b"n" * 16 + (c * 7).to_bytes(16, "little")
                t0 = time.perf_counter()
                if hasattr(t, "invalidate_chunks"):
                    got = t.invalidate_chunks([p])
                else:
                    got = t.invalidate(lambda k, p=p: k[:32] == p)
                times.append(time.perf_counter() - t0)
                assert got[0] == PER, got
            print(f"{n_chunks * PER:>9} objects: one chunk invalidated in {statistics.median(times) * 1e3:.3f} ms")
        finally:
            t.close()


if __name__ == "__main__":
    main()
