"""Run `orbitkv-bench pipeline` under torch.profiler (CUPTI sees every kernel and copy of the process: cupy's,
nvCOMP's, the engine's) and summarise the GPU's time inside each Manager.save / Manager.restore call of the
last repeat window: per activity (kernel name, copy direction) its count, summed time and bytes, and how much of
the call's wall time the GPU had any work in flight (the union of its intervals).
Usage: python gpu_trace.py OUT_DIR BENCH_ARGS...   (run from outside the checkout; writes OUT_DIR/trace.json)"""

from __future__ import annotations

import collections
import json
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def _annotate() -> None:
    from orbitkv_fs.manager import Manager

    for name in ("save", "restore"):
        orig = getattr(Manager, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            with record_function(f"okv.{_name}.{self.config().storage_codec}"):
                return _orig(self, *a, **k)
        setattr(Manager, name, wrapped)


def _union(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(iv):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _kind(ev: dict) -> str:
    if ev.get("cat") == "gpu_memcpy":
        return "copy " + ev["name"].replace("Memcpy ", "")
    if ev.get("cat") == "gpu_memset":
        return "memset"
    return ev["name"][:60]


def summarize(path: str) -> str:
    evs = json.load(open(path))["traceEvents"]
    gpu = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    calls = [e for e in evs if str(e.get("name", "")).startswith("okv.") and "dur" in e]
    lines = []
    by_call: dict[str, list[dict]] = collections.defaultdict(list)
    for c in calls:
        by_call[c["name"]].append(c)
    for name, cs in sorted(by_call.items()):
        wall = sum(c["dur"] for c in cs)
        acts: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
        iv, copies, kernels = [], [], []
        for c in cs:
            s, e = c["ts"], c["ts"] + c["dur"]
            for g in gpu:
                if s <= g["ts"] < e:
                    a = acts[_kind(g)]
                    a[0] += 1
                    a[1] += g["dur"]
                    a[2] += int(g.get("args", {}).get("bytes", 0))
                    iv.append((g["ts"], g["ts"] + g["dur"]))
                    (copies if g["cat"] == "gpu_memcpy" else kernels).append(iv[-1])
        lines.append(f"{name}: {len(cs)} calls, wall {wall / 1e3:.1f} ms, GPU busy {_union(iv) / 1e3:.1f} ms "
                     f"(kernels {_union(kernels) / 1e3:.1f}, copies {_union(copies) / 1e3:.1f})")
        for k, (n, t, b) in sorted(acts.items(), key=lambda kv: -kv[1][1]):
            rate = f"  {b / t / 1e3:8.1f} GB/s" if b and t else ""
            lines.append(f"    {k:<62} {n:>6} {t / 1e3:9.2f} ms {b / 2**20:10.1f} MiB{rate}")
    return "\n".join(lines)


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    _annotate()
    sys.argv = ["orbitkv-bench", "pipeline", *args]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_module("orbitkv_fs.tools.bench", run_name="__main__")
        except SystemExit:
            pass
    torch.cuda.synchronize()
    path = f"{out}/trace.json"
    prof.export_chrome_trace(path)
    text = summarize(path)
    open(f"{out}/gpu-summary.txt", "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
