"""Issue 24's H200 targets over a directory of `orbitkv-bench pipeline` runs (ab.sh's runs/VARIANT-ROUND/): per
codec and segment size, each run's save and restore against its bound (the best of its repeats, as the bench
reports it), and the host's own work per segment (thread CPU less GPU waits) call by call, the repeats after the
first, with each call's host probe. "Fast": calls whose probe was under LIMIT us (the lent host at full speed).
Usage: targets.py RUNS_DIR VARIANT [LIMIT_US]"""
import glob
import json
import statistics
import sys

runs_dir, variant = sys.argv[1], sys.argv[2]
limit = float(sys.argv[3]) if len(sys.argv) > 3 else 1150.0
rows: dict = {}
for path in sorted(glob.glob(f"{runs_dir}/{variant}-*/pipeline-gpu.json")):
    d = json.load(open(path))
    for r in d.get("throughput", d)["runs"]:
        rows.setdefault((r["codec"], r["segment_bytes"] >> 10), []).append(r)


def rng(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f} (median {statistics.median(xs):.2f})" if xs else "-"


print(f"| codec | segment | runs | save of bound | restore of bound | host us/seg save, every call | restore | "
      f"save, calls with probe < {limit:.0f} us | restore |")
print("| --- | ---: | ---: | --- | --- | --- | --- | --- | --- |")
for (codec, kib), rs in rows.items():
    save = [r["save_gbs"] / r["save_bound_gbs"] for r in rs]
    rest = [r["restore_gbs"] / r["restore_bound_gbs"] for r in rs]
    host = {"save": [], "restore": [], "save_fast": [], "restore_fast": []}
    for r in rs:
        for c in r["calls"]:
            if c["repeat"] < 1:
                continue
            for op in ("save", "restore"):
                us = c[f"{op}_host_us"] / r["segments"]
                host[op].append(us)
                if c[f"{op}_probe_us"] < limit:
                    host[f"{op}_fast"].append(us)
    print(f"| {codec} | {kib} KiB | {len(rs)} | {rng(save)} | {rng(rest)} | {rng(host['save'])} | "
          f"{rng(host['restore'])} | {rng(host['save_fast'])} | {rng(host['restore_fast'])} |")
