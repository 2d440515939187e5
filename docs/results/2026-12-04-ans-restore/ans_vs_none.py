"""`ans` against `none` in the same run of each round: logical GB/s ratio per round, save and restore, at each
segment size, for each tree of an ab.sh run directory (RUNS/<tree>-<round>/pipeline-gpu.json), with the round's
host probe (us, `none` 512 KiB's: higher on a slower host). Usage: python ans_vs_none.py RUNS > ans-vs-none.md"""

import glob
import json
import re
import sys


def main() -> None:
    runs = sys.argv[1]
    print("| tree | segment | rounds | ans/none save: min, median | rounds below 1 | ans/none restore: min, median "
          "| rounds below 1 |")
    print("| --- | ---: | ---: | --- | ---: | --- | ---: |")
    per_round = []
    for tree in ("base", "new"):
        rows = []
        for f in glob.glob(f"{runs}/{tree}-*/pipeline-gpu.json"):
            r = int(re.search(r"-(\d+)/pipeline", f).group(1))
            g = {(x["codec"], x["segment_bytes"] >> 10): x for x in json.load(open(f))["throughput"]["runs"]}
            for kib in (512, 4096):
                a, n = g[("ans", kib)], g[("none", kib)]
                rows.append((r, kib, a["save_gbs"] / n["save_gbs"], a["restore_gbs"] / n["restore_gbs"],
                             g[("none", 512)]["host_probe_us"]))
        for kib in (512, 4096):
            sel = sorted(x for x in rows if x[1] == kib)
            s = sorted(x[2] for x in sel)
            t = sorted(x[3] for x in sel)
            print(f"| {tree} | {kib} KiB | {len(sel)} | {s[0]:.2f}, {s[len(s) // 2]:.2f} | {sum(v < 1 for v in s)} "
                  f"| {t[0]:.2f}, {t[len(t) // 2]:.2f} | {sum(v < 1 for v in t)} |")
            per_round += [(tree, kib) + x[:1] + x[2:] for x in sel]
    print("\n| tree | segment | round | ans/none save | ans/none restore | host probe us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for tree, kib, r, s, t, p in per_round:
        print(f"| {tree} | {kib} KiB | {r} | {s:.2f} | {t:.2f} | {p:.0f} |")


if __name__ == "__main__":
    main()
