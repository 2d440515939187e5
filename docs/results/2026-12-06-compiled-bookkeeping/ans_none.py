"""`ans` against `none` run by run (the issue's targets: at least 1.2x at 4 MiB, never below 1.0x at 512 KiB), as the
bench records them (`save_vs_none`, `restore_vs_none` of each run's pipeline-gpu.json).
Usage: ans_none.py RUNS_DIR [VARIANT] > ans-none.md"""
import glob
import json
import os
import sys

runs, variant = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "new")
ratio: dict = {}
for f in sorted(glob.glob(os.path.join(runs, f"{variant}-*", "pipeline-gpu.json"))):
    for r in json.load(open(f))["throughput"]["runs"]:
        if r["codec"] == "ans":
            for op in ("save", "restore"):
                ratio.setdefault((r["segment_bytes"] >> 10, op), []).append(r[f"{op}_vs_none"])
print("| segment | op | runs | ans / none, least | median | most |")
print("| ---: | --- | ---: | ---: | ---: | ---: |")
for (kib, op), xs in sorted(ratio.items()):
    xs.sort()
    print(f"| {kib} KiB | {op} | {len(xs)} | {xs[0]:.2f} | {xs[len(xs) // 2]:.2f} | {xs[-1]:.2f} |")
