"""Who slows whom: QD1 64 KiB random reads next to a QD32 1 MiB sequential writer, every pairing of
tier and fio as reader and writer, the writer on a freshly preallocated (unwritten) file or on a
prefilled one, in one run and one directory. Prints one JSON line per case.

    flock /tmp/bench.lock python docs/results/2026-11-29-ssd-3/cross.py DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time

import orbitkv_fs.tools.bench_ssd as b

D = sys.argv[1]
FILL, SAT, RBS, WBS = 128 << 20, 1 << 30, 64 << 10, 1 << 20
RUNTIME = 1.5  # seconds of sampling per case: within the writer's first lap of SAT bytes


def fio_file(path: str, prefill: int) -> list[str]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, SAT)
    os.close(fd)
    common = [f"--filename={path}", "--direct=1", "--ioengine=io_uring", "--fallocate=none"]
    if prefill:
        b._fio(["--name=prefill", "--rw=write", "--bs=1m", "--iodepth=32", f"--size={prefill}", *common])
    return common


def fio_stats(job: dict) -> dict:
    c = job["read"]["clat_ns"]
    return {"p50_us": c["percentile"]["50.000000"] / 1e3, "p99_us": c["percentile"]["99.000000"] / 1e3,
            "mean_us": c["mean"] / 1e3, "n": job["read"]["total_ios"]}


def stats(lat: list[float]) -> dict:
    return {"p50_us": b._pct(lat, 50) * 1e6, "p99_us": b._pct(lat, 99) * 1e6,
            "mean_us": sum(lat) / len(lat) * 1e6, "n": len(lat)}


def emit(case: str, **kw: object) -> None:
    print(json.dumps({"case": case, **kw}), flush=True)


emit("start", loadavg=os.getloadavg())
fpath = os.path.join(D, "cross-fio.dat")
# fio reader, fio writer (one file: reader region prefilled, writer region fresh or prefilled)
for pre in (False, True):
    fd = os.open(fpath, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, FILL + SAT)
    os.close(fd)
    common = [f"--filename={fpath}", "--direct=1", "--ioengine=io_uring", "--fallocate=none"]
    b._fio(["--name=prefill", "--rw=write", "--bs=1m", "--iodepth=32", f"--size={FILL + SAT if pre else FILL}", *common])
    r = b._fio(["--name=writer", "--rw=write", "--bs=1m", "--iodepth=32", f"--offset={FILL}", f"--size={SAT}",
                "--time_based", f"--runtime={RUNTIME}", *common, "--name=reader", "--rw=randread", f"--bs={RBS}",
                "--iodepth=1", "--offset=0", f"--size={FILL}", "--time_based", f"--runtime={RUNTIME}", *common])
    jobs = {j["jobname"]: j for j in r["jobs"]}
    emit("fio reader + fio writer", writer_extents="prefilled" if pre else "fresh", **fio_stats(jobs["reader"]),
         writer_GBps=jobs["writer"]["write"]["bw_bytes"] / 1e9)
    os.unlink(fpath)

path = os.path.join(D, "cross.okv")
rkeys = [b._key(i, "r") for i in range(FILL // RBS)]
rnd = random.Random(1)
with b.SsdTier(b._config(path, FILL + SAT + (64 << 20), 32, WBS)) as t:
    b._submit_all(t, rkeys, b._segments(RBS, 16))
    t.flush()

    def sample(secs: float) -> list[float]:
        lat, end = [], time.perf_counter() + secs
        while time.perf_counter() < end:
            a = time.perf_counter()
            assert t.read(rkeys[rnd.randrange(len(rkeys))]) is not None
            lat.append(time.perf_counter() - a)
        return lat

    emit("tier reader, idle", **stats(sample(0.5)))
    # tier reader, fio writer (another process, another file of the same file system)
    for pre in (False, True):
        common = fio_file(fpath, SAT if pre else 0)
        p = subprocess.Popen(["fio", "--output-format=json", "--name=writer", "--rw=write", "--bs=1m", "--iodepth=32",
                              f"--size={SAT}", "--time_based", f"--runtime={RUNTIME + 0.5}", *common],
                             stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        lat = sample(RUNTIME - 0.2)
        o = p.communicate()[0]
        emit("tier reader + fio writer", writer_extents="prefilled" if pre else "fresh", **stats(lat),
             writer_GBps=json.loads(o[o.index("{"):])["jobs"][0]["write"]["bw_bytes"] / 1e9)
        os.unlink(fpath)
    # fio reader (reading the tier's shard), tier writer (this process, fresh extents of the same shard)
    wkeys = [b._key(i, "w") for i in range(SAT // WBS)]
    th = threading.Thread(target=lambda: (b._submit_all(t, wkeys, b._segments(WBS, 8)), t.flush()))
    before, t0 = t.snapshot().write_bytes_total, time.perf_counter()
    th.start()
    time.sleep(0.2)
    r = b._fio(["--name=reader", "--rw=randread", f"--bs={RBS}", "--iodepth=1", f"--filename={path}", "--offset=0",
                f"--size={FILL}", "--direct=1", "--ioengine=io_uring", "--time_based", f"--runtime={RUNTIME - 0.5}",
                "--fallocate=none"])
    w = (t.snapshot().write_bytes_total - before) / (time.perf_counter() - t0) / 1e9
    th.join()
    emit("fio reader + tier writer", writer_extents="fresh", **fio_stats(r["jobs"][0]), writer_GBps=w)
os.unlink(path)
emit("end", loadavg=os.getloadavg())
