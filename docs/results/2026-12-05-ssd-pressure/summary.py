"""Medians over the rounds of ab.sh's runs, per tree and mode, as a markdown table (ab.md).
Usage: python summary.py RUNS_DIR"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

runs = sys.argv[1]
rows: dict[tuple[str, str], list[dict]] = {}
for path in sorted(glob.glob(os.path.join(runs, "r*-*.json"))):
    tree = os.path.basename(path).rsplit("-", 1)[1][:-5]
    for r in json.load(open(path)):
        name = r["mode"] + ("" if r["policy"] == "lru" else ":" + r["policy"])
        rows.setdefault((name, tree), []).append(r)
med = lambda rs, f: statistics.median(r[f] for r in rs)  # noqa: E731
print("| mode | tree | rounds | save ms | GB/s | CPU us / segment | of which system | faults / segment | of fresh |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for mode in ("fresh", "pressure", "ssd", "ssd:s3fifo"):
    for tree in ("base", "new"):
        rs = rows.get((mode, tree))
        if not rs:
            continue
        fresh = med(rows[("fresh", tree)], "gb_per_s")
        print(f"| {mode} | {tree} | {len(rs)} | {med(rs, 'wall_ms'):.1f} | {med(rs, 'gb_per_s'):.2f} | "
              f"{med(rs, 'cpu_us_per_segment'):.2f} | {med(rs, 'sys_us_per_segment'):.2f} | "
              f"{med(rs, 'faults_per_segment'):.2f} | {med(rs, 'gb_per_s') / fresh:.2f} |")
ssd = {t: [r["wall_ms"] for r in rows[("ssd", t)]] for t in ("base", "new")}
print("\n`ssd` save, base / new per round: "
      + ", ".join(f"{b / n:.2f}x" for b, n in zip(ssd["base"], ssd["new"])))
