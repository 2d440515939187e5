"""Paired rounds of ab.sh / ab3.sh runs (two variants in the same round): per codec and segment size, the
median over rounds of new / base GB/s, each variant's median GB/s and share of the bound, and host work per
segment: CPU time where the run's waits sleep (its JSON says ``waits_sleep``), CPU less the GPU waits where
they spin. Usage: paired.py BASE NEW RUNS_DIR... > paired.md (variant names as in the runs' folder names)"""

import glob
import json
import os
import statistics
import sys


def rows(runs_dir: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(runs_dir, "*-*", "pipeline-gpu.json"))):
        variant, rnd = os.path.basename(os.path.dirname(path)).rsplit("-", 1)
        for r in json.load(open(path))["throughput"]["runs"]:
            host = {op: r[f"{op}_cpu_us_per_segment"] - (0 if r.get("waits_sleep") else r[f"{op}_wait_us_per_segment"])
                    for op in ("save", "restore")}
            out.append({"variant": variant, "round": int(rnd), "codec": r["codec"], "kib": r["segment_bytes"] >> 10,
                        "save": r["save_gbs"], "restore": r["restore_gbs"],
                        "save_of_bound": r["save_gbs"] / r["save_bound_gbs"],
                        "restore_of_bound": r["restore_gbs"] / r["restore_bound_gbs"],
                        "save_host_us": host["save"], "restore_host_us": host["restore"],
                        "save_cpu_us": r["save_cpu_us_per_segment"], "restore_cpu_us": r["restore_cpu_us_per_segment"],
                        "save_wait_us": r["save_wait_us_per_segment"],
                        "restore_wait_us": r["restore_wait_us_per_segment"]})
    return out


base, new = sys.argv[1:3]
pairs: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
for d in sys.argv[3:]:
    by = {(r["variant"], r["round"], r["codec"], r["kib"]): r for r in rows(d)}
    for (v, rnd, codec, kib), b in sorted(by.items()):
        n = by.get((new, rnd, codec, kib))
        if v == base and n is not None:
            pairs.setdefault((codec, kib), []).append((b, n))


def med(ps: list, side: int, key: str) -> float:
    return statistics.median(p[side][key] for p in ps)


b, n = base, new
print(f"| codec | segment | rounds | save GB/s {b} -> {n} (of bound) | restore GB/s {b} -> {n} (of bound) "
      f"| save {n}/{b} | restore {n}/{b} | host us/seg save {b} -> {n} | restore {b} -> {n} "
      f"| CPU us/seg save {b} -> {n} | restore {b} -> {n} | wait us/seg save {b} -> {n} | restore {b} -> {n} |")
print("| --- | ---: | ---: | --- | --- | ---: | ---: | --- | --- | --- | --- | --- | --- |")
order = ["none", "fp8", "turboquant-4", "turboquant-3", "ans"]
for (codec, kib), ps in sorted(pairs.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
    cells = [f"{med(ps, 0, op):.1f} ({med(ps, 0, op + '_of_bound'):.2f}) -> **{med(ps, 1, op):.1f}** "
             f"({med(ps, 1, op + '_of_bound'):.2f})" for op in ("save", "restore")]
    cells += [f"{statistics.median(n[op] / b[op] for b, n in ps):.2f}" for op in ("save", "restore")]
    cells += [f"{med(ps, 0, f'{op}_{k}_us'):.1f} -> {med(ps, 1, f'{op}_{k}_us'):.1f}"
              for k in ("host", "cpu", "wait") for op in ("save", "restore")]
    print(f"| {codec} | {kib} KiB | {len(ps)} | " + " | ".join(cells) + " |")
