#!/usr/bin/env bash
# The issue's CPU target, run after run: `none` at 32 KiB against its 4 MiB rate in the same run of the CPU bench
# (the host path: 8 layers, 512 blocks, best of 5 repeats each), RUNS runs one after another.
# Usage: cpu_ratio.sh OUT [RUNS]; prints each run's save and restore ratio and GB/s, then the lowest and median.
set -u
out=$1 runs=${2:-10}
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  orbitkv-bench pipeline --device cpu --only throughput --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 \
    --repeat 5 --out "$out/run-$i" > "$out/run-$i.log" 2>&1 || { echo "run $i failed"; tail -5 "$out/run-$i.log"; exit 1; }
done
python3 - "$out" "$runs" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
ratios = {"save": [], "restore": []}
for i in range(1, runs + 1):
    g = {x["segment_bytes"] >> 10: x for x in json.load(open(f"{out}/run-{i}/pipeline-cpu.json"))["throughput"]["runs"]}
    line = []
    for op in ("save", "restore"):
        r = g[32][f"{op}_gbs"] / g[4096][f"{op}_gbs"]
        ratios[op].append(r)
        line.append(f"{op} {r:.2f} ({g[32][f'{op}_gbs']:.2f} / {g[4096][f'{op}_gbs']:.2f} GB/s)")
    print(f"run {i}: " + ", ".join(line))
for op, v in ratios.items():
    print(f"{op}: lowest {min(v):.2f}, median {statistics.median(v):.2f}, runs under 0.65: {sum(x < 0.65 for x in v)} of {len(v)}")
PY
