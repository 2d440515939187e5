"""DRAM's `drain` as `Manager.flush_dram` calls it (slices of `max_bytes` until nothing is left), with N objects
of 400 bytes cached and slices of 2,048 objects (a 64 MiB slice of 32 KiB segments): total seconds, and the
longest single call (the DRAM lock is held for each call).

Usage: PYTHONPATH=<tree> python drain_cost.py OBJECTS..."""

from __future__ import annotations

import sys
import time

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import UNIT, DramTier

PER = 16


def main() -> None:
    for n in map(int, sys.argv[1:]):
        t = DramTier(n * UNIT + (1 << 20), pin=False)
        try:
            for c in range(n // PER):
                keys = [ObjectKey(b"n" * 16, c.to_bytes(16, "little"), layer, role).pack()
                        for layer in range(PER // 2) for role in (Role.KEY, Role.VALUE)]
                offs = t.reserve_many([400] * PER)
                t.publish_many(keys, offs, [400] * PER, [400] * PER, [0] * PER)
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
