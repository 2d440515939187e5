"""DRAM's `drain` as `Manager.flush_dram` calls it (slices of `max_bytes` until nothing is left), with N objects
of 400 bytes cached and slices of 2,048 objects (a 64 MiB slice of 32 KiB segments): total seconds, and the
longest single call (the DRAM lock is held for each call).

Usage: PYTHONPATH=<tree> python drain_cost.py OBJECTS..."""

from __future__ import annotations

import sys
import time

from filled import filled_tier


def main() -> None:
    for n in map(int, sys.argv[1:]):
        t = filled_tier(n)
        try:
            got, longest, t0 = 0, 0.0, time.perf_counter()
            while True:
                c0 = time.perf_counter()
                objs, _ = t.drain(2048 * 400)
                longest = max(longest, time.perf_counter() - c0)
                if not objs:
                    break
                got += len(objs)
            total = time.perf_counter() - t0
            assert got == n, (got, n)
            print(f"{n:>8} objects drained in {total:.2f} s, the longest call {longest * 1e3:.1f} ms")
        finally:
            t.close()


if __name__ == "__main__":
    main()
