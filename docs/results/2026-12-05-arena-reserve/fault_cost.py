"""What a fresh tmpfs arena costs its first writes: a 47 MB copy (a 1,024-token prefix of SmolLM2-135M in
float32) into a new /dev/shm file, sparse (pages faulted in by the copy), allocated with posix_fallocate (what
--reserve-pool does), and mapped with MAP_POPULATE; each against the same copy again (pages in place), and the
setup's own time for a 1 GiB file. Usage: python fault_cost.py [SHM_DIR]"""
import mmap
import os
import sys
import time

import numpy as np

d = sys.argv[1] if len(sys.argv) > 1 else "/dev/shm"
n, piece = 1 << 30, 47 << 20
src = np.random.default_rng(0).integers(0, 255, piece, dtype=np.uint8)
for mode in ("sparse", "fallocate", "populate"):
    p = os.path.join(d, f"okv-fault-{mode}")
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        os.ftruncate(fd, n)
        if mode == "fallocate":
            os.posix_fallocate(fd, 0, n)
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if mode == "populate" else 0))
        setup = time.perf_counter() - t0
        a = np.frombuffer(m, np.uint8)
        first, again = [], []
        for i in range(5):
            dst = a[i * piece:(i + 1) * piece]
            t = time.perf_counter()
            dst[:] = src
            t1 = time.perf_counter()
            dst[:] = src
            first.append(t1 - t)
            again.append(time.perf_counter() - t1)
        print(f"{mode:9s} setup {setup * 1e3:6.0f} ms for 1 GiB; a 47 MB copy, first: "
              + " ".join(f"{x * 1e3:5.1f}" for x in first) + " ms; again: "
              + " ".join(f"{x * 1e3:4.1f}" for x in again) + " ms")
        del a, dst
        m.close()
    finally:
        os.close(fd)
        os.unlink(p)
