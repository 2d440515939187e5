"""The DRAM tier under pressure as the GPU save path uses it: one reservation per batch (its output region, the
worst case of 64 segments of 600 KiB), the batch's segments published packed from its start (0.60-0.75 of
the worst case each), the region's unused tail given back; 200 batches into a pool of POOL regions (default
17). Prints evictions per batch, the median time of a reservation (after the first 50 batches: the pool full),
and the pool's share holding objects. Usage: python region_bench.py [POOL]"""
import random
import sys
import time

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import DramTier, UNIT
rnd = random.Random(1)
seg_worst, nseg = 600 << 10, 64           # worst-case slot per segment, segments per batch
region = seg_worst * nseg
t = DramTier(int(sys.argv[1]) * region if len(sys.argv) > 1 else 17 * region, pin=False)
chunk = 0
ev0, times = 0, []
for b in range(200):
    t0 = time.perf_counter()
    off = t.reserve(region)
    dt = time.perf_counter() - t0
    assert off is not None
    sizes = [int(seg_worst * rnd.uniform(0.6, 0.75)) // UNIT * UNIT for _ in range(nseg)]
    keys, offs, at = [], [], off
    for i, n in enumerate(sizes):
        keys.append(ObjectKey(b"n" * 16, (chunk + i // 16).to_bytes(16, "little"), i % 16, Role.KEY).pack())
        offs.append(at); at += n
    chunk += nseg // 16
    t.publish_many(keys, offs, sizes, sizes, [0] * nseg)
    used = at - off
    t.cancel(at, region - used)  # the gap goes back
    if b >= 50:
        times.append(dt)
print(f"evictions per batch {(t.evictions) / 200:.1f} (segments per batch {nseg}); reserve median {sorted(times)[len(times)//2]*1e6:.0f} us; "
      f"resident {t.used_bytes / t.capacity:.2f} of the pool")
t.close()
