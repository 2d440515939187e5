"""Summary of call1.sh's rounds (rNN-L<layers>/pipeline-gpu.json): per layer count, segment size and codec,
the best save and restore over the rounds, each against `none` and against its bound (the codec's stored
bytes at the pinned copy's rate, its work free) measured in the same round, and the medians of the rounds'
ratios. Prints markdown; with --json also writes summary.json next to the rounds.

    python summarize.py docs/results/2026-11-30-pipeline-gpu-10 [--json]
"""
import glob
import json
import os
import statistics
import sys


def rounds(folder: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "r*-L*/pipeline-gpu.json"))):
        layers = int(path.split("-L")[1].split("/")[0])
        t = json.load(open(path))["throughput"]
        out.setdefault(layers, []).append({(r["codec"], r["segment_bytes"]): r for r in t["runs"]})
    return out


def summarize(folder: str) -> list[dict]:
    rows = []
    for layers, rs in sorted(rounds(folder).items()):
        keys = list(rs[0])
        for codec, seg in keys:
            row = {"layers": layers, "codec": codec, "segment_kib": seg >> 10, "rounds": len(rs)}
            for op in ("save", "restore"):
                best = max(rs, key=lambda r: r[(codec, seg)][f"{op}_gbs"])
                r, none = best[(codec, seg)], best[("none", seg)]
                row[op] = {"best_gbs": r[f"{op}_gbs"], "vs_none": r[f"{op}_gbs"] / none[f"{op}_gbs"],
                           "none_vs_copy": none[f"{op}_gbs"] / none[f"{op}_baseline_gbs"],
                           "bound_vs_none": r[f"{op}_bound_vs_none"], "of_bound": r[f"{op}_gbs"] / r[f"{op}_bound_gbs"],
                           "median_vs_none": statistics.median(x[(codec, seg)][f"{op}_vs_none"] for x in rs),
                           "median_bound_vs_none": statistics.median(x[(codec, seg)][f"{op}_bound_vs_none"] for x in rs)}
            row["stored_over_logical"] = rs[0][(codec, seg)]["stored_bytes"] / rs[0][(codec, seg)]["logical_bytes"]
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| layers | codec | segment | stored / logical | save best GB/s (x none; its bound x none; of bound) | "
           "restore best GB/s (x none; its bound x none; of bound) | medians x none save / restore | "
           "median bound x none save / restore |", "| ---: | --- | ---: | ---: | --- | --- | --- | --- |"]
    for r in rows:
        s, t = r["save"], r["restore"]
        out.append(f"| {r['layers']} | {r['codec']} | {r['segment_kib']} KiB | {r['stored_over_logical']:.3f} | "
                   f"{s['best_gbs']:.1f} ({s['vs_none']:.2f}; {s['bound_vs_none']:.2f}; {s['of_bound']:.0%}) | "
                   f"{t['best_gbs']:.1f} ({t['vs_none']:.2f}; {t['bound_vs_none']:.2f}; {t['of_bound']:.0%}) | "
                   f"{s['median_vs_none']:.2f} / {t['median_vs_none']:.2f} | "
                   f"{s['median_bound_vs_none']:.2f} / {t['median_bound_vs_none']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    folder = sys.argv[1]
    rows = summarize(folder)
    print(markdown(rows))
    if "--json" in sys.argv:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(rows, f, indent=1)
