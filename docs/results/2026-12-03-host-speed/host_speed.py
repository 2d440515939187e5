"""Where the lent GPU host's speed varies: by core, or over time. The bench's host probe
(``orbitkv_fs.tools.bench_pipeline._host_probe_us``: a fixed dict, list and small-numpy workload, best of five)
read 900-1,900 us between and within the bench's processes, and its slow readings went with slow host work.
``cores``: the probe pinned to each CPU in turn (PASSES passes over the CPUs, REPS probes per CPU), so a core
that is slow every pass shows as such. ``series``: the probe every INTERVAL seconds for SECONDS, unpinned or
pinned to CPU, so drift over time shows. Prints JSON lines.
Usage: host_speed.py cores [PASSES=2] [REPS=15] | host_speed.py series [SECONDS=30] [INTERVAL=0.05] [CPU]"""

import ctypes
import json
import os
import statistics as st
import sys
import time

from orbitkv_fs.tools.bench_pipeline import _host_probe_us

_getcpu = ctypes.CDLL(None).sched_getcpu


def _cores(passes: int, reps: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    for p in range(passes):
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            xs = [_host_probe_us() for _ in range(reps)]
            print(json.dumps({"pass": p, "cpu": cpu, "min_us": round(min(xs)), "median_us": round(st.median(xs)),
                              "max_us": round(max(xs))}), flush=True)
    os.sched_setaffinity(0, set(cpus))


def _series(seconds: float, interval: float, cpu: "int | None") -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    t0 = time.perf_counter()
    xs = []
    while time.perf_counter() - t0 < seconds:
        xs.append((round(time.perf_counter() - t0, 3), round(_host_probe_us()), _getcpu()))
        time.sleep(interval)
    probes = [x[1] for x in xs]
    print(json.dumps({"cpu": cpu, "n": len(xs), "min_us": min(probes), "median_us": st.median(probes),
                      "max_us": max(probes), "series": xs}), flush=True)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "cores":
        _cores(int(args[0]) if args else 2, int(args[1]) if len(args) > 1 else 15)
    else:
        _series(float(args[0]) if args else 30.0, float(args[1]) if len(args) > 1 else 0.05,
                int(args[2]) if len(args) > 2 else None)


if __name__ == "__main__":
    main()
