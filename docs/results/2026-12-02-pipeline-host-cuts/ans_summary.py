"""Every `ans` figure of this session's A/B runs (97b31c3 as base, 09294e2 as new), per segment size: each run's
save / restore GB/s, and the medians. Sources: ans-ab/*/{base,new}-N/pipeline-gpu.json (ab.sh runs) and
ans-ab/gc-runs.txt (gc_bench.py runs, gc on and off). Usage: python ans_summary.py > ans-summary.md"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

here = Path(__file__).parent / "ans-ab"
runs: dict[tuple[str, int], list[tuple[str, float, float]]] = {}
for f in sorted(here.glob("*/*-*/pipeline-gpu.json")):
    tree = f.parent.name.split("-")[0]
    for r in json.loads(f.read_text())["throughput"]["runs"]:
        if r["codec"] == "ans":
            runs.setdefault((tree, r["segment_bytes"] >> 10), []).append((f"{f.parent.parent.name}/{f.parent.name}",
                                                                          r["save_gbs"], r["restore_gbs"]))
tree = seg = gc = None
for line in (here / "gc-runs.txt").read_text().splitlines():
    m = re.match(r"== (\w+) seg=(\d+) gc_off=(\d)", line)
    if m:
        tree, seg, gc = m.group(1), int(m.group(2)), m.group(3)
        continue
    m = re.match(r"\s+ans\s+(\d+) KiB\s+save ([\d.]+) GB/s\s+restore ([\d.]+) GB/s", line)
    if m and tree:
        runs.setdefault((tree, seg), []).append((f"gc_bench gc_off={gc}", float(m.group(2)), float(m.group(3))))
print("| segment | tree | runs | save GB/s (each) | restore GB/s (each) | median save / restore |")
print("| --- | --- | ---: | --- | --- | ---: |")
for seg in sorted({s for _, s in runs}):
    for tree in ("base", "new"):
        rs = runs.get((tree, seg), [])
        if rs:
            sv, rv = [r[1] for r in rs], [r[2] for r in rs]
            print(f"| {seg} KiB | {tree} | {len(rs)} | {', '.join(f'{x:.1f}' for x in sv)} | "
                  f"{', '.join(f'{x:.1f}' for x in rv)} | {statistics.median(sv):.1f} / {statistics.median(rv):.1f} |")
