"""The experiment that found the cause (run against 1352fbf, whose staging buffers were 4 KiB pages; on
later code the tier stages in huge pages itself): fio's QD1 reader on the tier's shard while the tier's
writer thread writes 1 MiB records at QD32, with the tier's staging buffers on 4 KiB pages (as they were)
and in 2 MiB huge pages (monkeypatched), and the disk's write requests from /proc/diskstats.
Output: hugepages.txt.

    flock /tmp/bench.lock python docs/results/2026-11-29-ssd-3/hugepages.py DIR
"""
import json, mmap, os, sys, threading, time
import orbitkv_fs.tools.bench_ssd as b
import orbitkv_fs.tiers.ssd.tier as T
D = sys.argv[1]; FILL, SAT, RBS, WBS = 128 << 20, 1 << 30, 64 << 10, 1 << 20
orig = T.aligned_buffer
def thp_buffer(n):
    if n < (1 << 20):
        return orig(n)
    m = mmap.mmap(-1, 2 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(m)
def ds():
    for l in open("/proc/diskstats"):
        f = l.split()
        if f[2] == "vda":
            v = [int(x) for x in f[3:]]
            return v[4], v[6], v[7]
print("load", os.getloadavg())
for rep in range(2):
  for thp in (False, True):
    T.aligned_buffer = thp_buffer if thp else orig
    path = os.path.join(D, "thp.okv")
    with b.SsdTier(b._config(path, FILL + SAT + (64 << 20), 32, WBS)) as t:
        b._submit_all(t, [b._key(i, "r") for i in range(FILL // RBS)], b._segments(RBS, 16)); t.flush()
        wkeys = [b._key(i, "w") for i in range(SAT // WBS)]
        th = threading.Thread(target=lambda: (b._submit_all(t, wkeys, b._segments(WBS, 8)), t.flush()))
        a = ds(); t0 = time.perf_counter(); th.start(); time.sleep(0.2)
        r = b._fio(["--name=reader", "--rw=randread", f"--bs={RBS}", "--iodepth=1", f"--filename={path}", "--offset=0",
                    f"--size={FILL}", "--direct=1", "--ioengine=io_uring", "--time_based", "--runtime=1", "--fallocate=none"])
        th.join(); dt = time.perf_counter() - t0; z = ds()
        c = r["jobs"][0]["read"]["clat_ns"]
        print("thp" if thp else "4k ", {"p50_us": round(c["percentile"]["50.000000"] / 1e3), "mean_us": round(c["mean"] / 1e3), "n": r["jobs"][0]["read"]["total_ios"],
              "w_req_kib": round((z[1] - a[1]) * 512 / max(1, z[0] - a[0]) / 1024), "w_await_ms": round((z[2] - a[2]) / max(1, z[0] - a[0]), 1), "wGBps": round(SAT / dt / 1e9, 3)}, flush=True)
    os.unlink(path)
print("load", os.getloadavg())
