"""Per round of ab.sh runs: new's median host work per segment per ms of probe over base's, for each codec, size and
op, and how many rounds read lower on new. A round whose base or new run is missing is left out. The host's speed
changes within a process, so each call is read with its own probe (as by_call.py).
Usage: rounds.py RUNS_DIR"""

import glob
import json
import os
import re
import statistics as st
import sys


def _per_run(path: str) -> dict:
    """{(codec, KiB, op): median host us per segment per ms of probe} over a run's calls after its first repeat."""
    out: dict = {}
    for r in json.load(open(path))["throughput"]["runs"]:
        for op in ("save", "restore"):
            xs = [c[f"{op}_host_us"] / r["segments"] / (c[f"{op}_probe_us"] / 1000)
                  for c in r.get("calls", []) if c["repeat"] >= 1]
            if xs:
                out[(r["codec"], r["segment_bytes"] >> 10, op)] = st.median(xs)
    return out


def main() -> None:
    runs: dict = {}
    for path in glob.glob(os.path.join(sys.argv[1], "*-*", "pipeline-gpu.json")):
        m = re.fullmatch(r"(base|new)-(\d+)", os.path.basename(os.path.dirname(path)))
        if m:
            runs[(m[1], int(m[2]))] = _per_run(path)
    rounds = sorted(n for v, n in runs if v == "base" and ("new", n) in runs)
    print(f"{len(rounds)} rounds with both trees\n")
    print("| codec | segment | op | new/base median | range | rounds lower on new |\n| --- | ---: | --- | ---: | --- | ---: |")
    for codec in ("none", "fp8", "turboquant-4", "ans"):
        for kib in (512, 4096):
            for op in ("save", "restore"):
                k = (codec, kib, op)
                r = [runs[("new", n)][k] / runs[("base", n)][k] for n in rounds]
                print(f"| {codec} | {kib} KiB | {op} | {st.median(r):.2f} | {min(r):.2f}-{max(r):.2f} | "
                      f"{sum(x < 1 for x in r)} of {len(r)} |")


if __name__ == "__main__":
    main()
