"""The 32 KiB / 4 MiB ratios of each run of ab.sh (pipeline-cpu.json), pair by pair. Usage: ratios.py OUT_DIR"""
import glob
import json
import os
import statistics
import sys

rows = []
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*-*")), key=lambda p: int(p.rsplit("-", 1)[1])):
    runs = {r["segment_bytes"] >> 10: r for r in json.load(open(os.path.join(d, "pipeline-cpu.json")))["throughput"]["runs"]}
    small, big = runs[32], runs[4096]
    rows.append((os.path.basename(d), small["save_gbs"] / big["save_gbs"], small["restore_gbs"] / big["restore_gbs"],
                 small["save_gbs"], big["save_gbs"], small["host_probe_us"]))
print("| run | save 32 KiB / 4 MiB | restore 32 KiB / 4 MiB | save GB/s 32 KiB | 4 MiB | host probe us |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for name, s, r, a, b, p in rows:
    print(f"| {name} | {s:.3f} | {r:.3f} | {a:.2f} | {b:.2f} | {p:.0f} |")
for v in ("base", "new"):
    mine = [x for x in rows if x[0].startswith(v + "-")]
    if mine:
        print(f"\n{v}: save ratio median {statistics.median(x[1] for x in mine):.3f} (lowest {min(x[1] for x in mine):.3f},"
              f" under 0.65 in {sum(x[1] < 0.65 for x in mine)} of {len(mine)}); restore median "
              f"{statistics.median(x[2] for x in mine):.3f} (lowest {min(x[2] for x in mine):.3f})")
