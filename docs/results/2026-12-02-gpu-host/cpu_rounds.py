"""Each run of cpu_throughput_ab.sh (or run.sh) as a row: `none` 32 KiB and 4 MiB save / restore GB/s, their
ratio (the issue's CPU target: 32 KiB save at >= 0.65 of 4 MiB in the same run), host CPU us per 32 KiB segment;
then the medians per tree. Usage: python cpu_rounds.py DIR > DIR/rounds.md"""

import glob
import json
import os
import re
import statistics
import sys

d = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(d, "throughput-*-*", "pipeline-cpu.json"))):
    tree, rnd = re.match(r"throughput-(\w+)-(\d+)", os.path.basename(os.path.dirname(path))).groups()
    runs = {r["segment_bytes"]: r for r in json.load(open(path))["throughput"]["runs"]}
    s, b = runs[32 << 10], runs[4 << 20]
    rows.append({"tree": tree, "round": int(rnd), "s32": s["save_gbs"], "r32": s["restore_gbs"], "s4": b["save_gbs"],
                 "r4": b["restore_gbs"], "save_ratio": s["save_gbs"] / b["save_gbs"],
                 "restore_ratio": s["restore_gbs"] / b["restore_gbs"], "save_us": s["save_cpu_us_per_segment"],
                 "restore_us": s["restore_cpu_us_per_segment"]})
print("| tree | round | 32 KiB save / restore GB/s | 4 MiB save / restore GB/s | 32 KiB / 4 MiB save | restore | host us per 32 KiB segment save / restore |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in sorted(rows, key=lambda r: (r["round"], r["tree"])):
    print(f"| {r['tree']} | {r['round']} | {r['s32']:.2f} / {r['r32']:.2f} | {r['s4']:.2f} / {r['r4']:.2f} | "
          f"{r['save_ratio']:.2f} | {r['restore_ratio']:.2f} | {r['save_us']:.2f} / {r['restore_us']:.2f} |")
for tree in ("base", "new"):
    x = [r for r in rows if r["tree"] == tree]
    if x:
        m = {k: statistics.median(r[k] for r in x) for k in ("s32", "r32", "s4", "r4", "save_ratio", "restore_ratio",
                                                               "save_us", "restore_us")}
        print(f"| {tree} | median | {m['s32']:.2f} / {m['r32']:.2f} | {m['s4']:.2f} / {m['r4']:.2f} | "
              f"{m['save_ratio']:.2f} | {m['restore_ratio']:.2f} | {m['save_us']:.2f} / {m['restore_us']:.2f} |")
