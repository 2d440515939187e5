"""``SsdTier.submit_many`` as DRAM's eviction calls it: batches of 72 records of 36 KiB (a chunk of 36 layers,
K and V, 32 KiB segments), each batch a new chunk, the lane drained every 8 batches; a 2 GiB shard that the
144,000 records lap about 2.5 times (every place taken evicts). Median of this thread's CPU per record in
``submit_many``: the caller pays the staging copy, the places, the headers and the queueing (the lane's own
thread writes).

Usage: PYTHONPATH=<tree> python submit_many.py DIR"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

BATCHES = 2000


def main() -> None:
    payload = 32768 - 64
    segs = [build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), payload, payload, 0),
                          np.random.default_rng(i).integers(0, 256, payload, dtype=np.uint8)) for i in range(8)]
    path = os.path.join(sys.argv[1], f"submit-many-{os.getpid()}.okv")
    try:
        with SsdTier(SsdConfig(paths=(path,), capacity=2 << 30)) as t:
            cpu = []
            for b in range(BATCHES):
                keys = [ObjectKey(b"submit-many-benc", chunk_key(b), j // 2, Role.KEY if j % 2 else Role.VALUE)
                        for j in range(72)]
                c0 = time.thread_time()
                got = t.submit_many(keys, [segs[j % 8] for j in range(72)])
                cpu.append((time.thread_time() - c0) / 72)
                assert got == 72, got
                if b % 8 == 7:
                    t.flush()
            s = t.snapshot()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"submit_many of 72 records of 36 KiB: median {statistics.median(cpu) * 1e6:.2f} us CPU a record "
          f"({s.evicted_total} records evicted)")


if __name__ == "__main__":
    main()
