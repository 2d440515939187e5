"""The slowed-host rounds (call.sh slow) run by run: per variant, the restore's and save's share of the bound, the
host's own work per segment restored (thread CPU less GPU waits) and the host probe, then each variant's medians
and how many runs fell under 0.8. Usage: slow.py RUNS_DIR (ab.sh's runs/, from c4/runs.tgz) > slow.md"""
import glob
import json
import os
import statistics
import sys

rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*-*", "pipeline-gpu.json"))):
    variant, rnd = os.path.basename(os.path.dirname(path)).rsplit("-", 1)
    for r in json.load(open(path))["throughput"]["runs"]:
        rows.append({"variant": variant, "round": int(rnd), "probe": r["host_probe_us"],
                     "restore": r["restore_gbs"] / r["restore_bound_gbs"], "save": r["save_gbs"] / r["save_bound_gbs"],
                     "host": r["restore_cpu_us_per_segment"] - r["restore_wait_us_per_segment"]})
print("| variant | runs | restore of bound, median (range) | restore runs under 0.8 | save of bound, median | "
      "save runs under 0.8 | host us/seg restored, median | host probe us, median (range) |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
for v in sorted({r["variant"] for r in rows}):
    rs = [r for r in rows if r["variant"] == v]
    res, sav, host, probe = ([r[k] for r in rs] for k in ("restore", "save", "host", "probe"))
    print(f"| {v} | {len(rs)} | {statistics.median(res):.3f} ({min(res):.3f}-{max(res):.3f}) | "
          f"{sum(x < 0.8 for x in res)} | {statistics.median(sav):.3f} | {sum(x < 0.8 for x in sav)} | "
          f"{statistics.median(host):.2f} | {statistics.median(probe):.0f} ({min(probe):.0f}-{max(probe):.0f}) |")
print("\n| round | variant | restore of bound | save of bound | host us/seg restored | host probe us |")
print("| ---: | --- | ---: | ---: | ---: | ---: |")
for r in sorted(rows, key=lambda r: (r["round"], r["variant"])):
    print(f"| {r['round']} | {r['variant']} | {r['restore']:.3f} | {r['save']:.3f} | {r['host']:.2f} | "
          f"{r['probe']:.0f} |")
