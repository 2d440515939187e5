"""The SSD ring's allocation with N records in a shard, in the steady state of a full tier: every new record
takes the place of the oldest ones at the head, which sweeps the ring. Drives :class:`Shard` as the lane's
``_allocate`` and ``_place`` do (``find_room``, the victims removed, the new slot inserted), with no I/O, so
that what is timed is the ring's bookkeeping alone. Records of 36 KiB (a 32 KiB segment's record); the
head starts mid-lap, where a record's place is in the middle of the shard's offsets.

Usage: PYTHONPATH=<tree> python ring_steady.py N...   Prints, per N, the median of 5 rounds of 2,000
records: us per record."""

from __future__ import annotations

import statistics
import sys
import time

from orbitkv_fs.tiers.ssd.ring import Shard, Slot, State
from orbitkv_fs.tiers.ssd.superblock import RING_START

REC = 36 << 10


def _slot(offset: int, gen: int) -> Slot:
    s = Slot(0, offset, REC, None, gen, REC - 128, None, 0)
    s.state = State.COMMITTED
    return s


def steady(n: int, rounds: int = 5, per: int = 2000) -> float:
    sh = Shard(0, "", 0, RING_START + n * REC, b"\0" * 32, -1)
    for i in range(n):
        sh.insert(_slot(RING_START + i * REC, i))
    sh.head = RING_START + (n // 2) * REC
    gen, times = n, []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per):
            pos, victims, _skips = sh.find_room(REC)
            for v in victims:
                sh.remove(v)
            sh.head = pos + REC
            sh.insert(_slot(pos, gen))
            gen += 1
        times.append((time.perf_counter() - t0) / per)
    assert len(sh.slots) == n
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{int(arg):>9} records: {steady(int(arg)):.2f} us per record")
