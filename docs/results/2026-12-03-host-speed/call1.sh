#!/usr/bin/env bash
# Device call 1: the whole GPU suite on this tree (the GPU engine's host code changed after the last H200 suite),
# then the lent host's facts (lscpu, SMT siblings, clock, steal) and host_speed.py: the probe on each core in turn
# and the probe as a time series, unpinned and pinned.
# Usage, from the repository root after the device prelude: call1.sh OUT
set -u
out=$1
mkdir -p "$out"
start=$(date +%s)
timeout 440 python3 -m pytest -q -m gpu tests/ -rs --durations=25 > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
{
  lscpu; echo; nproc; echo
  for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename "$c") siblings $(cat "$c/topology/thread_siblings_list" 2>/dev/null) core $(cat "$c/topology/core_id" 2>/dev/null) pkg $(cat "$c/topology/physical_package_id" 2>/dev/null)"; done
  echo; grep MHz /proc/cpuinfo; echo; head -1 /proc/stat; cat /proc/loadavg
} > "$out/host-facts.txt" 2>&1
python3 docs/results/2026-12-03-host-speed/host_speed.py cores 3 12 > "$out/cores.jsonl" 2>&1
python3 docs/results/2026-12-03-host-speed/host_speed.py series 25 0.05 > "$out/series-unpinned.json" 2>&1
python3 docs/results/2026-12-03-host-speed/host_speed.py series 15 0.05 3 > "$out/series-cpu3.json" 2>&1
{ head -1 /proc/stat; cat /proc/loadavg; grep MHz /proc/cpuinfo; } >> "$out/host-facts.txt" 2>&1
python3 - "$out" <<'PY'
import json, sys, collections
out = sys.argv[1]
by = collections.defaultdict(list)
for line in open(f"{out}/cores.jsonl"):
    if line.startswith("{"):
        r = json.loads(line); by[r["cpu"]].append(r["median_us"])
for cpu, xs in sorted(by.items()):
    print("cpu", cpu, "medians by pass", xs)
for name in ("series-unpinned", "series-cpu3"):
    r = json.loads(open(f"{out}/{name}.json").read().splitlines()[-1])
    print(name, {k: r[k] for k in ("n", "min_us", "median_us", "max_us")})
PY
echo "call done in $(( $(date +%s) - start )) s"
