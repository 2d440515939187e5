"""Paired rounds of ab3.sh runs (base and new in the same round, one after the other): per codec, the median
over rounds of new / base host work per segment (CPU less GPU waits) and GB/s, all rounds and the rounds whose
two processes' host probes are within 1.15x of each other. Usage: paired.py RUNS_DIR... > paired.md"""

import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/2026-12-02-batch-1024")
from summarize import rows  # noqa: E402

pairs: dict[str, list[tuple[dict, dict]]] = {}
for d in sys.argv[1:]:
    by = {(r["variant"], r["round"], r["codec"]): r for r in rows(d)}
    for (v, rnd, codec), b in by.items():
        n = by.get(("new", rnd, codec))
        if v == "base" and n is not None:
            pairs.setdefault(codec, []).append((b, n))


def med(ps: list, key: str) -> str:
    return f"{statistics.median(n[key] / b[key] for b, n in ps):.2f}" if ps else "-"


print("| codec | rounds | host us/seg save new/base | restore | GB/s save new/base | restore | rounds at a like host speed "
      "| host save | restore | GB/s save | restore |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for codec, ps in pairs.items():
    like = [(b, n) for b, n in ps if max(b["probe_us"], n["probe_us"]) <= 1.15 * min(b["probe_us"], n["probe_us"])]
    print(f"| {codec} | {len(ps)} | {med(ps, 'save_host_us')} | {med(ps, 'restore_host_us')} | {med(ps, 'save')} | "
          f"{med(ps, 'restore')} | {len(like)} | {med(like, 'save_host_us')} | {med(like, 'restore_host_us')} | "
          f"{med(like, 'save')} | {med(like, 'restore')} |")
