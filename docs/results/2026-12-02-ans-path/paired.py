"""Paired rounds of ab3.sh runs (base and new in the same round): per codec and segment size, the median over
rounds of new / base GB/s and host work per segment (CPU less GPU waits), and each tree's median GB/s and
share of the bound. Usage: paired.py RUNS_DIR... > paired.md"""

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "2026-12-02-batch-1024"))
from summarize import rows  # noqa: E402

pairs: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
for n_dir, d in enumerate(sys.argv[1:]):
    by = {(r["variant"], r["round"], r["codec"], r["kib"]): r for r in rows(d)}
    for (v, rnd, codec, kib), b in sorted(by.items()):
        n = by.get(("new", rnd, codec, kib))
        if v == "base" and n is not None:
            pairs.setdefault((codec, kib), []).append((b, n))


def ratio(ps: list, key: str) -> str:
    return f"{statistics.median(n[key] / b[key] for b, n in ps):.2f}"


def med(ps: list, side: int, key: str) -> float:
    return statistics.median(p[side][key] for p in ps)


print("| codec | segment | rounds | save GB/s base -> new (of bound) | restore GB/s base -> new (of bound) "
      "| save new/base | restore new/base | host us/seg save base -> new | restore base -> new |")
print("| --- | ---: | ---: | --- | --- | ---: | ---: | --- | --- |")
order = ["none", "fp8", "turboquant-4", "ans"]
for (codec, kib), ps in sorted(pairs.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
    cells = []
    for op in ("save", "restore"):
        cells.append(f"{med(ps, 0, op):.1f} ({med(ps, 0, op + '_of_bound'):.2f}) -> "
                     f"**{med(ps, 1, op):.1f}** ({med(ps, 1, op + '_of_bound'):.2f})")
    print(f"| {codec} | {kib} KiB | {len(ps)} | {cells[0]} | {cells[1]} | {ratio(ps, 'save')} | {ratio(ps, 'restore')} | "
          f"{med(ps, 0, 'save_host_us'):.1f} -> {med(ps, 1, 'save_host_us'):.1f} | "
          f"{med(ps, 0, 'restore_host_us'):.1f} -> {med(ps, 1, 'restore_host_us'):.1f} |")
