"""QD1 demand-read latency of 64 KiB segments (64 records, 3,000 reads): a tree against another, alternating.
Usage: QD1_DIR=/tmp/ssdx PYTHONPATH=TREE python qd1.py TREE"""
import sys, time, os
sys.path.insert(0, sys.argv[1] + "/tests")
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from test_ssd_common import key, segment
p = os.environ.get("QD1_DIR", "/tmp/ssdx") + f"/qd1-{os.getpid()}.okv"
t = SsdTier(SsdConfig(paths=(p,), capacity=64 << 20))
for i in range(64): t.submit(key(i), segment(i, n=32768))
t.flush()
lat = []
for r in range(3000):
    k = key(r % 64)
    t0 = time.perf_counter(); t.read(k); lat.append(time.perf_counter() - t0)
lat.sort()
print(sys.argv[1], "p50 %.1f us  p90 %.1f us" % (lat[len(lat)//2] * 1e6, lat[int(len(lat)*0.9)] * 1e6))
t.close(); os.unlink(p)
