"""The copy a demotion cannot skip, alone: each evicted 32 KiB segment (plus its 64-byte header) from a DRAM
arena extent into an SSD staging buffer, as pressure_ssd.py's `ssd` mode moves them (8,192 segments a save, a
pool of one save's bytes, the lane's staging buffers cycling through 288 MiB: a buffer comes back only after
the others were written, so neither side is in cache). No Python per segment beyond the copy call.

Usage: PYTHONPATH=<tree> python floor.py   Prints the median of 8 rounds: us per segment."""

from __future__ import annotations

import statistics
import time

import numpy as np

from orbitkv_fs.tiers.dram import Arena
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE, record_length
from orbitkv_fs.tiers.ssd.staging import StagingPool

SEG = (32 << 10) + 64
N = 8192


def main() -> None:
    arena = Arena(N * (SEG + 512), pin=False)
    src = memoryview(arena.buf)
    np.frombuffer(arena.buf, np.uint8)[:] = 7  # the arena's pages exist, as after the saves that filled it
    rec = record_length(SEG)
    pool = StagingPool(300 << 20)
    bufs = [pool.host(rec) for _ in range((288 << 20) // rec)]
    for b in bufs:
        b[:] = bytes(len(b))  # faulted in: the steady state reuses buffers
    step = -(-SEG // 512) * 512
    times = []
    k = 0
    for _ in range(8):
        t0 = time.perf_counter()
        for i in range(N):
            bufs[k % len(bufs)][RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + SEG] = src[i * step:i * step + SEG]
            k += 1
        times.append((time.perf_counter() - t0) / N)
    print(f"copy of a {SEG}-byte segment, arena to staging, cold: {statistics.median(times) * 1e6:.2f} us per segment")
    del src
    arena.close()


if __name__ == "__main__":
    main()
