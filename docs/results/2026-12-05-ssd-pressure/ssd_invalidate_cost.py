"""SSD tier: time of `invalidate(namespace=, chunks=[one])` (what an engine's invalidation of its own chunk
costs the tier; its tombstone written and synced, a checkpoint) with N records in one shard, 16 segments a
chunk, 4 KiB segments (8 KiB records) so that a shard holds many. Median of 5 calls, each on a chunk
present. The shard file is written afresh by each run.

Usage: PYTHONPATH=<tree> python ssd_invalidate_cost.py DIR RECORDS..."""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

PER = 16
NS = b"n" * 16


def main() -> None:
    d = sys.argv[1]
    x = np.random.default_rng(0).standard_normal(2048).astype(np.float16)
    segs = [encode_segment(x, "none", role="key", layer=i) for i in range(PER)]
    for n in map(int, sys.argv[2:]):
        path = os.path.join(d, f"inval-{os.getpid()}.okv")
        t = SsdTier(SsdConfig(paths=(path,), capacity=n * 8192 + (64 << 20)))
        try:
            for c in range(n // PER):
                for i in range(PER):
                    assert t.submit(ObjectKey(NS, chunk_key(c), i, Role.KEY), segs[i], timeout=10.0)
            t.flush()
            times = []
            for j in range(5):
                t0 = time.perf_counter()
                r = t.invalidate(namespace=NS, chunks=[chunk_key(j * 11)])
                times.append(time.perf_counter() - t0)
                assert r.objects == PER, r
            print(f"{t.snapshot().objects + 5 * PER:>8} records: one chunk invalidated in "
                  f"{statistics.median(times) * 1e3:.1f} ms")
        finally:
            t.close()
            os.unlink(path)


if __name__ == "__main__":
    main()
