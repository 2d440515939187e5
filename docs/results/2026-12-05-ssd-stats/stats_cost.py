"""What one SSD tier `stats()` (a Prometheus scrape's share, an admin `stats` call) costs, with the tier's
latency windows full (4,096 read and 4,096 write samples): median wall time of REPS calls. The scrape holds
the GIL throughout, so every engine's call waits that long.

Usage: PYTHONPATH=<tree> python stats_cost.py DIR [REPS]"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier


def main() -> None:
    path = os.path.join(sys.argv[1], f"stats-{os.getpid()}.okv")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rng = random.Random(1)
    try:
        with SsdTier(SsdConfig(paths=(path,), capacity=64 << 20)) as t:
            t._read_lat.extend(rng.expovariate(5e4) for _ in range(4096))
            t._write_lat.extend(rng.expovariate(5e3) for _ in range(4096))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                t.stats()
                times.append(time.perf_counter() - t0)
            print(f"SsdTier.stats() with full latency windows: {statistics.median(times) * 1e6:.0f} us "
                  f"(median of {reps})")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
