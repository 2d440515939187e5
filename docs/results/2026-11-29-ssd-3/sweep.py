# Cap sweep of write_bytes_while_reading (run against 9e773b1: 4 KiB staging pages). Output: sweep.txt.
import dataclasses, os, sys

import orbitkv_fs.tools.bench_ssd as b
D = sys.argv[1]
orig = b._config
print("load", os.getloadavg(), flush=True)
for rep in range(2):
    for cap in (1 << 20, 2 << 20, 4 << 20, 8 << 20):
        b._config = lambda *a, cap=cap: dataclasses.replace(orig(*a), write_bytes_while_reading=cap)
        r = b._saturated(os.path.join(D, "sweep.okv"), 256 << 20, 1 << 30, 32, 2000, True)
        print(cap >> 20, "MiB", {k: round(r[k], 3) for k in ("saturated_read_p50_us", "saturated_read_p99_us", "saturated_read_mean_us", "write_GBps_while_sampling")}, r["saturated_samples"], flush=True)
print("load", os.getloadavg(), flush=True)
