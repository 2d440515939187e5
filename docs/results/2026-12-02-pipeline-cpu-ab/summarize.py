"""Summarise run.sh: per tree and round, `none` 32 KiB save/restore GB/s over the same round's 4 MiB (the
issue's CPU target, >= 0.65), and the data plane's lookup p50 and the index's bytes per segment. Writes
summary.json and prints a markdown table. Usage: python summarize.py [DIR]"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def main(d: str) -> None:
    rows, out = [], {"rounds": {}, "dataplane": {}}
    for v in ("base", "new"):
        ratios = []
        for path in sorted(glob.glob(os.path.join(d, f"throughput-{v}-*", "pipeline-cpu.json"))):
            runs = {r["segment_bytes"]: r for r in json.load(open(path))["throughput"]["runs"]}
            small, big = runs[32 << 10], runs[4 << 20]
            ratios.append({"save_32k_gbs": small["save_gbs"], "restore_32k_gbs": small["restore_gbs"],
                           "save_4m_gbs": big["save_gbs"], "restore_4m_gbs": big["restore_gbs"],
                           "save_ratio": small["save_gbs"] / big["save_gbs"],
                           "restore_ratio": small["restore_gbs"] / big["restore_gbs"],
                           "save_us_per_32k_segment": small["save_cpu_us_per_segment"],
                           "restore_us_per_32k_segment": small["restore_cpu_us_per_segment"]})
        out["rounds"][v] = ratios
        dp = json.load(open(os.path.join(d, f"dataplane-index-{v}", "pipeline-cpu.json")))
        lookup = dp["dataplane"]
        index = dp["index"]
        out["dataplane"][v] = {"dataplane": lookup, "index": index}
        med = {k: statistics.median(r[k] for r in ratios) for k in ratios[0]}
        rows.append((v, med))
    json.dump(out, open(os.path.join(d, "summary.json"), "w"), indent=2)
    print("| tree | 32 KiB save / restore GB/s | 4 MiB save / restore GB/s | 32 KiB / 4 MiB save | 32 KiB / 4 MiB restore "
          "| host CPU us per 32 KiB segment save / restore |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for v, m in rows:
        print(f"| {v} | {m['save_32k_gbs']:.2f} / {m['restore_32k_gbs']:.2f} | {m['save_4m_gbs']:.2f} / "
              f"{m['restore_4m_gbs']:.2f} | {m['save_ratio']:.2f} | {m['restore_ratio']:.2f} | "
              f"{m['save_us_per_32k_segment']:.1f} / {m['restore_us_per_32k_segment']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
