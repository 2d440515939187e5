"""Every run of the H200 A/B calls (ab-h200/call*/{base,new}-N): GB/s per codec, and the restore's
phase-1 host time per segment (restore_acquire: code this change did not touch, so it reads the speed of
the process's host; runs of a bench that records it also show its host probe). Usage: python ab_runs.py > ab-runs.md"""

from __future__ import annotations

import json
from pathlib import Path

here = Path(__file__).parent / "ab-h200"
codecs = ("none", "fp8", "turboquant-4")
print("| call / run | " + " | ".join(f"{c} save / restore GB/s" for c in codecs)
      + " | fp8 host us/seg save (publish) / restore | restore_acquire us/seg (fp8) | host probe us |")
print("| --- |" + " ---: |" * (len(codecs) + 3))
for f in sorted(here.glob("call*/*-*/pipeline-gpu.json"), key=lambda p: (p.parent.parent.name, p.parent.name.split("-")[1])):
    runs = {r["codec"]: r for r in json.loads(f.read_text())["throughput"]["runs"]}
    fp8 = runs["fp8"]
    st = fp8["stage_cpu_us_per_segment"]
    cells = [f"{runs[c]['save_gbs']:.1f} / {runs[c]['restore_gbs']:.1f}" for c in codecs]
    print(f"| {f.parent.parent.name} {f.parent.name} | " + " | ".join(cells)
          + f" | {fp8['save_cpu_us_per_segment'] - fp8['save_wait_us_per_segment']:.2f} ({st['save_publish']:.2f})"
          f" / {fp8['restore_cpu_us_per_segment'] - fp8['restore_wait_us_per_segment']:.2f} | {st['restore_acquire']:.2f} | "
          + (f"{fp8['host_probe_us']:.0f} |" if "host_probe_us" in fp8 else "- |"))
