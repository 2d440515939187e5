"""Summarise ab.sh's runs: per codec and segment size, each variant's best and median over rounds (save and
restore GB/s, the fraction of the bound, host CPU and GPU wait per segment), and new / base. Usage:
python summarize.py OUT  -> OUT/ab.json and OUT/ab.md."""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def main(out: str) -> None:
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for path in sorted(glob.glob(os.path.join(out, "*-*", "pipeline-gpu.json"))):
        variant = os.path.basename(os.path.dirname(path)).split("-")[0]
        runs[variant].append(json.load(open(path)))
    rows = []
    keys = sorted({(r["codec"], r["segment_bytes"]) for res in runs["new"] for r in res["throughput"]["runs"]},
                  key=lambda k: (k[1], ["none", "fp8", "turboquant-4", "ans"].index(k[0]) if k[0] in
                                 ("none", "fp8", "turboquant-4", "ans") else 9))
    for codec, size in keys:
        row: dict = {"codec": codec, "segment_kib": size >> 10}
        for v in ("base", "new"):
            got = [r for res in runs[v] for r in res["throughput"]["runs"]
                   if r["codec"] == codec and r["segment_bytes"] == size]
            for op in ("save", "restore"):
                gbs = [r[f"{op}_gbs"] for r in got]
                frac = [r[f"{op}_gbs"] / r[f"{op}_bound_gbs"] for r in got]
                row[f"{v}_{op}_gbs_best"], row[f"{v}_{op}_gbs_median"] = max(gbs), statistics.median(gbs)
                row[f"{v}_{op}_of_bound_best"] = max(frac)
                row[f"{v}_{op}_cpu_us_median"] = statistics.median(r[f"{op}_cpu_us_per_segment"] for r in got)
                row[f"{v}_{op}_wait_us_median"] = statistics.median(r.get(f"{op}_wait_us_per_segment", float("nan"))
                                                                    for r in got)
            row[f"{v}_rounds"] = len(got)
        for op in ("save", "restore"):
            row[f"{op}_new_vs_base_median"] = row[f"new_{op}_gbs_median"] / row[f"base_{op}_gbs_median"]
        rows.append(row)
    json.dump({"rows": rows, "host": runs["new"][0]["host"] if runs["new"] else ""}, open(os.path.join(out, "ab.json"), "w"),
              indent=2)
    lines = ["| codec | segment | base save / restore GB/s (median) | new save / restore GB/s (median) | new / base "
             "save, restore | new of bound (best) save / restore | new host us/seg save / restore (CPU - wait) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['segment_kib']} KiB | {r['base_save_gbs_median']:.1f} / {r['base_restore_gbs_median']:.1f} | "
            f"{r['new_save_gbs_median']:.1f} / {r['new_restore_gbs_median']:.1f} | {r['save_new_vs_base_median']:.2f}, "
            f"{r['restore_new_vs_base_median']:.2f} | {r['new_save_of_bound_best']:.2f} / {r['new_restore_of_bound_best']:.2f} | "
            f"{r['new_save_cpu_us_median'] - r['new_save_wait_us_median']:.1f} / "
            f"{r['new_restore_cpu_us_median'] - r['new_restore_wait_us_median']:.1f} |")
    open(os.path.join(out, "ab.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
