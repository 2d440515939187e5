import os, sys, time, tempfile, resource
sys.path.insert(0, "/work/main")
from tools import bench_ssd as b
d = tempfile.mkdtemp(dir="/var/tmp")
size = 512 << 20
bs = 64 << 10
out = []
for qd in (8, 32, 32):
    n = size // bs
    segs = b._segments(bs, 16)
    keys = [b._key(i, f"x{qd}-") for i in range(n)]
    path = os.path.join(d, "q.okv")
    with b._tier(path, n * bs + (64 << 20), qd, bs) as t:
        r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        b._submit_all(t, keys, segs); t.flush()
        dt = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.unlink(path)
    out.append(f"qd{qd} {n*bs/dt/1e9:.3f} GB/s cpu/rec {(r1.ru_utime-r0.ru_utime+r1.ru_stime-r0.ru_stime)/n*1e6:.0f}us")
print(sys.argv[1], " | ".join(out), flush=True)
