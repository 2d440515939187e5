"""`ans` against `none` run by run (the issue's targets: at least 1.2x at 4 MiB, never below 1.0x at 512 KiB), from
the bench's pipeline-gpu.json of each run. Usage: ans_none.py RUNS_DIR [VARIANT] > ans-none.md"""
import glob
import json
import os
import sys

runs, variant = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "new")
ratio: dict = {}
for f in sorted(glob.glob(os.path.join(runs, f"{variant}-*", "pipeline-gpu.json"))):
    d = json.load(open(f))
    by = {(r["codec"], r["segment_bytes"] >> 10): r for r in d.get("throughput", d)["runs"]}
    for kib in sorted({k for _, k in by}):
        if ("ans", kib) in by and ("none", kib) in by:
            for op in ("save", "restore"):
                ratio.setdefault((kib, op), []).append(by["ans", kib][f"{op}_gbs"] / by["none", kib][f"{op}_gbs"])
print("| segment | op | runs | ans / none, least | median | most |")
print("| ---: | --- | ---: | ---: | ---: | ---: |")
for (kib, op), xs in sorted(ratio.items()):
    xs.sort()
    print(f"| {kib} KiB | {op} | {len(xs)} | {xs[0]:.2f} | {xs[len(xs) // 2]:.2f} | {xs[-1]:.2f} |")
