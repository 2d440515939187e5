"""Paired ab.sh rounds of two variants, kept only where both processes' host probes read fast (below LIMIT us at
that segment size: the lent host's probe is bimodal, ~900-1000 us or ~1,400-1,800 us, and a slow process's host
work reads ~1.5x), medians base -> new of each codec's share of its bound and host us per segment (CPU less GPU
waits). Usage: fast_probe.py RUNS_DIR [LIMIT=1150] (variants named base and new)."""

import glob
import json
import os
import statistics as st
import sys


def main() -> None:
    runs, limit = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1150
    rows = {}
    for path in glob.glob(os.path.join(runs, "*-*", "pipeline-gpu.json")):
        v, r = os.path.basename(os.path.dirname(path)).rsplit("-", 1)
        for x in json.load(open(path))["throughput"]["runs"]:
            rows[(v, int(r), x["codec"], x["segment_bytes"] >> 10)] = x
    rounds = sorted({k[1] for k in rows})
    print("| codec | segment | rounds | save of bound base -> new | restore of bound | host us/seg save | restore |")
    print("| --- | ---: | ---: | --- | --- | --- | --- |")
    for codec in ("none", "fp8", "turboquant-4", "ans"):
        for kib in (512, 4096):
            pr = [r for r in rounds if all((v, r, codec, kib) in rows
                                           and rows[(v, r, codec, kib)]["host_probe_us"] < limit
                                           for v in ("base", "new"))]
            if not pr:
                continue

            def med(v, f):
                return st.median(f(rows[(v, r, codec, kib)]) for r in pr)

            def col(f, fmt):
                return f"{med('base', f):{fmt}} -> {med('new', f):{fmt}}"

            cols = [col(lambda x: x["save_gbs"] / x["save_bound_gbs"], ".2f"),
                    col(lambda x: x["restore_gbs"] / x["restore_bound_gbs"], ".2f"),
                    col(lambda x: x["save_cpu_us_per_segment"] - x["save_wait_us_per_segment"], ".1f"),
                    col(lambda x: x["restore_cpu_us_per_segment"] - x["restore_wait_us_per_segment"], ".1f")]
            print(f"| {codec} | {kib} KiB | {len(pr)} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
