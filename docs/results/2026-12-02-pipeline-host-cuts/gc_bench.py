"""Run `orbitkv-bench pipeline` and account for the garbage collector: the count and seconds of collections per
generation (gc.callbacks), over the whole run. With GC_OFF=1 automatic collections are off (gc.disable) and
only the bench's own gc.collect() runs. Usage: python gc_bench.py BENCH_ARGS... (prints one `gc:` line)."""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time

started: dict[int, float] = {}
count = [0, 0, 0]
seconds = [0.0, 0.0, 0.0]


def _on_gc(phase: str, info: dict) -> None:
    g = info["generation"]
    if phase == "start":
        started[g] = time.perf_counter()
    elif g in started:
        count[g] += 1
        seconds[g] += time.perf_counter() - started.pop(g)


def main() -> None:
    if os.environ.get("GC_OFF") == "1":
        gc.disable()
    gc.callbacks.append(_on_gc)
    sys.argv = ["orbitkv-bench", "pipeline", *sys.argv[1:]]
    try:
        runpy.run_module("orbitkv_fs.tools.bench", run_name="__main__")
    except SystemExit:
        pass
    print("gc: " + "  ".join(f"gen{g} {count[g]} x {seconds[g] * 1e3:.1f} ms" for g in range(3)), flush=True)


if __name__ == "__main__":
    main()
