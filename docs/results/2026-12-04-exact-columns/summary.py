"""Summary of ab.sh's runs: per tree, `none` 32 KiB against its 4 MiB rate (save, restore) run by run, the
lowest and the median, and the 32 KiB host work per segment by stage (medians).

Usage: python summary.py OUT [RUNS]"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(out: Path, tree: str, i: int) -> dict[int, dict]:
    runs = json.loads((out / f"{tree}-{i}" / "pipeline-cpu.json").read_text())["throughput"]["runs"]
    return {r["segment_bytes"] >> 10: r for r in runs}


def main() -> None:
    out = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else len(list(out.glob("new-*.log")))
    stages = ("save", "save_encode", "save_publish", "save_other", "restore", "restore_verify", "restore_write")
    print("| tree | save 32 KiB / 4 MiB: lowest | median | runs under 0.65 | restore: lowest | median | "
          "32 KiB save GB/s (median) | 4 MiB save GB/s | " + " | ".join(f"{s} us/seg" for s in stages) + " |")
    print("| --- " * (8 + len(stages)) + "|")
    for tree in ("base", "new"):
        g = [load(out, tree, i) for i in range(1, n + 1)]
        save = [r[32]["save_gbs"] / r[4096]["save_gbs"] for r in g]
        rest = [r[32]["restore_gbs"] / r[4096]["restore_gbs"] for r in g]
        st = {s: statistics.median(r[32]["stage_cpu_us_per_segment"][s] for r in g) for s in stages}
        print(f"| {tree} | {min(save):.3f} | {statistics.median(save):.3f} | {sum(x < 0.65 for x in save)} of {n} | "
              f"{min(rest):.3f} | {statistics.median(rest):.3f} | "
              f"{statistics.median(r[32]['save_gbs'] for r in g):.2f} | {statistics.median(r[4096]['save_gbs'] for r in g):.2f} | "
              + " | ".join(f"{st[s]:.2f}" for s in stages) + " |")
    print()
    print("Run by run (save ratio base / new, restore ratio base / new):")
    for i in range(1, n + 1):
        b, w = load(out, "base", i), load(out, "new", i)
        print(f"  {i:2d}: save {b[32]['save_gbs'] / b[4096]['save_gbs']:.3f} / {w[32]['save_gbs'] / w[4096]['save_gbs']:.3f}"
              f"   restore {b[32]['restore_gbs'] / b[4096]['restore_gbs']:.3f} / {w[32]['restore_gbs'] / w[4096]['restore_gbs']:.3f}")


if __name__ == "__main__":
    main()
