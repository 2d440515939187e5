"""The tables of README.md from the JSON of run.sh (python summarise.py, in this directory)."""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = ("main", "before", "after")


def load(pattern: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {t: [] for t in TREES}
    for t in TREES:
        for d in sorted(glob.glob(os.path.join(HERE, pattern.format(tree=t)))):
            with open(os.path.join(d, "pipeline-cpu.json")) as f:
                out[t].append(json.load(f))
    return out


def runs(res: dict) -> dict[int, dict]:
    return {r["segment_bytes"] >> 10: r for r in res["throughput"]["runs"]}


def main() -> None:
    tp = load("throughput-{tree}-*")
    print("| code | round | 32 KiB save / restore GB/s | 4 MiB save / restore GB/s | 32 KiB / 4 MiB save | "
          "32 KiB / 4 MiB restore | host CPU us/segment at 32 KiB save / restore |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios: dict[str, list[tuple[float, float]]] = {t: [] for t in TREES}
    for t in TREES:
        for i, res in enumerate(tp[t], 1):
            r = runs(res)
            s, b = r[32], r[4096]
            rs, rr = s["save_gbs"] / b["save_gbs"], s["restore_gbs"] / b["restore_gbs"]
            ratios[t].append((rs, rr))
            print(f"| {t} | {i} | {s['save_gbs']:.2f} / {s['restore_gbs']:.2f} | {b['save_gbs']:.2f} / "
                  f"{b['restore_gbs']:.2f} | {rs:.2f} | {rr:.2f} | {s['save_cpu_us_per_segment']:.1f} / "
                  f"{s['restore_cpu_us_per_segment']:.1f} |")
    print()
    print("| code | median 32 KiB / 4 MiB save | median 32 KiB / 4 MiB restore |")
    print("| --- | ---: | ---: |")
    for t in TREES:
        if ratios[t]:
            print(f"| {t} | {statistics.median(x for x, _ in ratios[t]):.2f} | "
                  f"{statistics.median(y for _, y in ratios[t]):.2f} |")
    print()
    names = ["save", "save_encode", "save_publish", "save_other", "restore", "restore_acquire", "restore_verify",
             "restore_write", "restore_other"]
    print("Host CPU us per segment per stage (median of the rounds):")
    print()
    print("| code | segment | " + " | ".join(names) + " |")
    print("| --- | ---: |" + " ---: |" * len(names))
    for t in ("before", "after"):
        for kib in (32, 4096):
            vals = []
            for k in names:
                xs = [runs(res)[kib]["stage_cpu_us_per_segment"].get(k) for res in tp[t]]
                xs = [x for x in xs if x is not None]
                vals.append(f"{statistics.median(xs):.2f}" if xs else "-")
            print(f"| {t} | {kib} KiB | " + " | ".join(vals) + " |")
    print()
    dp = load("dataplane-index-{tree}")
    print("| code | lookup_64 p50 / p99 us | empty lookup p50 us | index B/segment (60 / 2 / 1 segments per chunk) |")
    print("| --- | ---: | ---: | ---: |")
    for t in TREES:
        for res in dp[t]:
            d = res["dataplane"]
            ix = " / ".join(f"{x['index_bytes_per_segment']:.0f}" for x in res["index"])
            print(f"| {t} | {d['lookup_64']['p50_us']:.0f} / {d['lookup_64']['p99_us']:.0f} | "
                  f"{d['empty_lookup']['p50_us']:.0f} | {ix} |")


if __name__ == "__main__":
    main()
