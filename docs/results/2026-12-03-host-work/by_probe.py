"""Medians per variant over the runs whose host probe (the bench's fixed host workload, microseconds, measured
per segment size before its runs) was under a limit: on a lent host whose speed moved 1.7x within one call,
pairs by round compare a fast process of one tree with a slow one of the other. Usage:
by_probe.py RUNS_DIR LIMIT_US VARIANTS..."""
import glob
import json
import statistics
import sys

runs_dir, limit, variants = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
rows: dict = {}
for path in sorted(glob.glob(f"{runs_dir}/*/pipeline-gpu.json")):
    v = path.split("/")[-2].rsplit("-", 1)[0]
    d = json.load(open(path))
    for r in d.get("throughput", d)["runs"]:
        if v in variants and r["host_probe_us"] < limit:
            key = (r["codec"], r["segment_bytes"] >> 10)
            rows.setdefault(key, {}).setdefault(v, []).append(r)


def med(rs, f):
    return statistics.median(f(r) for r in rs)


print(f"| codec | segment | runs ({', '.join(variants)}) | save GB/s (of bound) | restore GB/s (of bound) | host us/seg save | restore |")
print("| --- | ---: | --- | --- | --- | --- | --- |")
for (codec, kib), by in rows.items():
    cells = [[], [], [], [], []]
    for v in variants:
        rs = by.get(v, [])
        if not rs:
            for c in cells:
                c.append("-")
            continue
        cells[0].append(str(len(rs)))
        cells[1].append(f"{med(rs, lambda r: r['save_gbs']):.1f} ({med(rs, lambda r: r['save_gbs'] / r['save_bound_gbs']):.2f})")
        cells[2].append(f"{med(rs, lambda r: r['restore_gbs']):.1f} ({med(rs, lambda r: r['restore_gbs'] / r['restore_bound_gbs']):.2f})")
        cells[3].append(f"{med(rs, lambda r: r['save_cpu_us_per_segment'] - r['save_wait_us_per_segment']):.1f}")
        cells[4].append(f"{med(rs, lambda r: r['restore_cpu_us_per_segment'] - r['restore_wait_us_per_segment']):.1f}")
    print(f"| {codec} | {kib} KiB | " + " | ".join(" / ".join(c) for c in cells) + " |")
