"""ab.sh runs by call: every save and restore the bench timed after a run's first repeat, each with the host probe
taken right before it (the bench's ``calls``). The lent host runs a core at full speed (probe ~900-1,100 us) or
about 1.65x slower for seconds at a time (host_speed.py), so a call is read with its own probe, not its
process's. Prints, per codec, segment size and variant: calls, the median share of the bound over all calls and
over the calls whose probe read below LIMIT us (the host at full speed), and the median host work per segment
per ms of probe; then new over base where both variants ran.
Usage: by_call.py RUNS_DIR [RUNS_DIR ...] [--limit 1150]"""

import argparse
import glob
import json
import os
import statistics as st


def _calls(dirs: list[str]) -> dict:
    """{(variant, codec, KiB): [(op, share of bound, probe us, host us per segment), ...]}"""
    out: dict = {}
    for d in dirs:
        for path in glob.glob(os.path.join(d, "*-*", "pipeline-gpu.json")):
            v = os.path.basename(os.path.dirname(path)).rsplit("-", 1)[0]
            for r in json.load(open(path))["throughput"]["runs"]:
                rows = out.setdefault((v, r["codec"], r["segment_bytes"] >> 10), [])
                for c in r.get("calls", []):
                    if c["repeat"] < 1:
                        continue
                    for op in ("save", "restore"):
                        share = r["logical_bytes"] / c[f"{op}_s"] / 1e9 / r[f"{op}_bound_gbs"]
                        rows.append((op, share, c[f"{op}_probe_us"], c[f"{op}_host_us"] / r["segments"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--limit", type=float, default=1150.0)
    a = p.parse_args()
    calls = _calls(a.runs)
    variants = sorted({k[0] for k in calls})
    print(f"| codec | segment | variant | op | calls | of bound, all calls | calls probe < {a.limit:.0f} us | "
          "of bound, those calls | host us/seg per ms of probe |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    norm: dict = {}
    for codec in ("none", "fp8", "turboquant-4", "ans"):
        for kib in (512, 4096):
            for op in ("save", "restore"):
                for v in variants:
                    rows = [x for x in calls.get((v, codec, kib), []) if x[0] == op]
                    if not rows:
                        continue
                    fast = [x[1] for x in rows if x[2] < a.limit]
                    n = st.median(x[3] / (x[2] / 1000) for x in rows)
                    norm[(v, codec, kib, op)] = n
                    print(f"| {codec} | {kib} KiB | {v} | {op} | {len(rows)} | {st.median(x[1] for x in rows):.2f} | "
                          f"{len(fast)} | {st.median(fast) if fast else float('nan'):.2f} | {n:.2f} |")
    if {"base", "new"} <= set(variants):
        print("\n| codec | segment | host work per ms of probe new/base, save | restore |\n| --- | ---: | ---: | ---: |")
        for codec in ("none", "fp8", "turboquant-4", "ans"):
            for kib in (512, 4096):
                if not all(("base", codec, kib, op) in norm and ("new", codec, kib, op) in norm
                           for op in ("save", "restore")):
                    continue
                r = [norm[("new", codec, kib, op)] / norm[("base", codec, kib, op)] for op in ("save", "restore")]
                print(f"| {codec} | {kib} KiB | {r[0]:.2f} | {r[1]:.2f} |")


if __name__ == "__main__":
    main()
