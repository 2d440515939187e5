"""Issue 24's `turboquant-4` figures against the host: per codec and segment size of `orbitkv-bench pipeline` runs
(ab.sh's runs/VARIANT-ROUND/pipeline-gpu.json), the copy's time per segment at the bound (stored bytes at the
pinned copy's rate) beside the host's own work per segment (thread CPU less counted GPU waits, the repeats after
the first, median per run) and the host probe, and how the share of the bound reached follows the host: runs split
at the median probe. Where the host's work per segment nears the copy's, the pipeline cannot hide its serial parts
(the first batch's lease, checks and start; the rest's lease and check) and the share of the bound falls with the
host's speed. Usage: host_bound.py RUNS_DIR VARIANT"""
import glob
import json
import statistics
import sys

runs_dir, variant = sys.argv[1], sys.argv[2]
rows: dict = {}
for path in sorted(glob.glob(f"{runs_dir}/{variant}-*/pipeline-gpu.json")):
    d = json.load(open(path))
    for r in d.get("throughput", d)["runs"]:
        rows.setdefault((r["codec"], r["segment_bytes"] >> 10), []).append(r)

print("| codec | segment | op | copy at bound us/seg | host work us/seg (median) | host / copy | of bound, runs with "
      "probe under the median | over it | runs under 0.8, fast / slow probe |")
print("| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- |")
for (codec, kib), rs in rows.items():
    probes = statistics.median(r["host_probe_us"] for r in rs)
    for op in ("save", "restore"):
        copy_us = statistics.median(r["stored_bytes"] / r["segments"] / (r[f"{op}_baseline_gbs"] * 1e3) for r in rs)
        host = statistics.median(statistics.median(c[f"{op}_host_us"] for c in r["calls"] if c["repeat"] >= 1)
                                 / r["segments"] for r in rs)
        fast = [r[f"{op}_gbs"] / r[f"{op}_bound_gbs"] for r in rs if r["host_probe_us"] <= probes]
        slow = [r[f"{op}_gbs"] / r[f"{op}_bound_gbs"] for r in rs if r["host_probe_us"] > probes]

        def rng(xs: list) -> str:
            return f"{min(xs):.2f}-{max(xs):.2f} (median {statistics.median(xs):.2f})" if xs else "-"

        print(f"| {codec} | {kib} KiB | {op} | {copy_us:.2f} | {host:.2f} | {host / copy_us:.2f} | {rng(fast)} | "
              f"{rng(slow)} | {sum(x < 0.8 for x in fast)} / {sum(x < 0.8 for x in slow)} |")
print(f"\nhost probe: median {probes:.0f} us over {len(rs)} runs (range "
      f"{min(r['host_probe_us'] for r in rs):.0f}-{max(r['host_probe_us'] for r in rs):.0f})")
