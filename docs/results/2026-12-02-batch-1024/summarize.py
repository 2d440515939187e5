"""Summary of ab3.sh's runs (all, then those at the same host speed): per variant, codec and segment size, each run's save / restore GB/s, their share
of the bound the bench prints (the codec's stored bytes at the pinned copy's rate), host CPU us per segment
less the GPU waits, and the run's host probe; then the medians. Usage: summarize.py RUNS_DIR [OUT.md]"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def rows(runs_dir: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(runs_dir, "*-*", "pipeline-gpu.json"))):
        variant, rnd = os.path.basename(os.path.dirname(path)).rsplit("-", 1)
        res = json.load(open(path))
        for r in res["throughput"]["runs"]:
            out.append({"variant": variant, "round": int(rnd), "codec": r["codec"], "kib": r["segment_bytes"] >> 10,
                        "save": r["save_gbs"], "restore": r["restore_gbs"],
                        "save_of_bound": r["save_gbs"] / r["save_bound_gbs"],
                        "restore_of_bound": r["restore_gbs"] / r["restore_bound_gbs"],
                        "save_host_us": r["save_cpu_us_per_segment"] - r["save_wait_us_per_segment"],
                        "restore_host_us": r["restore_cpu_us_per_segment"] - r["restore_wait_us_per_segment"],
                        "probe_us": r.get("host_probe_us", float("nan")),
                        "batch_segments": res["throughput"]["geometry"]["batch_segments"]})
    return out


def each(g: list[dict], field: str, fmt: str) -> str:
    return ", ".join(format(r[field], fmt) for r in g)


def table(rs: list[dict]) -> str:
    lines = ["| codec | segment | variant (batch_segments) | runs | save GB/s, each run | restore GB/s, each run | "
             "median save / restore of bound | median host us/seg save / restore | host probe us |",
             "| --- | ---: | --- | ---: | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["kib"], r["codec"], r["variant"]) for r in rs},
                  key=lambda k: (k[0], ["none", "fp8", "turboquant-4", "turboquant-3", "ans"].index(k[1]), k[2]))
    for kib, codec, variant in keys:
        g = sorted([r for r in rs if (r["kib"], r["codec"], r["variant"]) == (kib, codec, variant)],
                   key=lambda r: r["round"])
        med = lambda f: statistics.median([r[f] for r in g])  # noqa: E731
        lines.append(f"| {codec} | {kib} KiB | {variant} ({g[0]['batch_segments']}) | {len(g)} | "
                     f"{each(g, 'save', '.1f')} | {each(g, 'restore', '.1f')} | "
                     f"{med('save_of_bound'):.2f} / {med('restore_of_bound'):.2f} | "
                     f"{med('save_host_us'):.2f} / {med('restore_host_us'):.2f} | "
                     f"{each(g, 'probe_us', '.0f')} |")
    return "\n".join(lines)


#: A run's host probe at most this much above the call's fastest: the runs at the same host speed.
FAST = 1.15


if __name__ == "__main__":
    rs = rows(sys.argv[1])
    fastest = min(r["probe_us"] for r in rs)
    fast = [r for r in rs if r["probe_us"] <= FAST * fastest]
    text = (f"All runs:\n\n{table(rs)}\n\nRuns whose host probe is within {FAST:.2f}x of the call's fastest "
            f"({fastest:.0f} us), the others ran their host code slower:\n\n{table(fast)}")
    print(text)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(sys.argv[2])[0] + ".json", "w") as f:
            json.dump(rs, f, indent=1)
