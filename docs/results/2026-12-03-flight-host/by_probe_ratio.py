"""Host work per segment scaled by the host's speed at the time: each run's host us/seg (CPU less GPU waits)
divided by its host probe (the bench's fixed host workload, us, measured before the figures of each segment
size) -- microseconds of host work per millisecond of probe -- medians per variant, and new over base; a lent
host's speed moved 1.8x within the call, and the runs of one tree caught more of its slow stretches than the
other's. Usage: by_probe_ratio.py RUNS_DIR BASE NEW"""
import glob
import json
import statistics
import sys

runs_dir, base, new = sys.argv[1:4]
rows: dict = {}
for path in sorted(glob.glob(f"{runs_dir}/*/pipeline-gpu.json")):
    v = path.split("/")[-2].rsplit("-", 1)[0]
    for r in json.load(open(path))["throughput"]["runs"]:
        key = (r["codec"], r["segment_bytes"] >> 10)
        p = r["host_probe_us"] / 1000
        for op in ("save", "restore"):
            host = r[f"{op}_cpu_us_per_segment"] - r[f"{op}_wait_us_per_segment"]
            rows.setdefault(key, {}).setdefault((v, op), []).append(host / p)
print(f"| codec | segment | host us/seg per ms of probe, save {base} -> {new} | new/{base} | restore {base} -> {new} | new/{base} |")
print("| --- | ---: | --- | ---: | --- | ---: |")
for (codec, kib), by in rows.items():
    cells = []
    for op in ("save", "restore"):
        b, n = statistics.median(by[(base, op)]), statistics.median(by[(new, op)])
        cells += [f"{b:.2f} -> {n:.2f}", f"{n / b:.2f}"]
    print(f"| {codec} | {kib} KiB | " + " | ".join(cells) + " |")
