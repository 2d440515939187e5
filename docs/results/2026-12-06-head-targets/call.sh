#!/usr/bin/env bash
# One device call at this tree: optionally the GPU suite (SUITE=1) and the timeline of the 512 KiB saves and
# restores, then as many rounds of the command (every codec, 512 KiB and 4 MiB, three repeats) as fit
# in what is left of LIMIT seconds from the script's start, for the targets (../2026-12-05-h200/targets.py over OUT/ab/runs).
# Usage, from the repository root after the device prelude: [SUITE=1] call.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
mkdir -p "$out"
if [ "${SUITE:-0}" = 1 ]; then
  timeout 420 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
  echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
  ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
  timeout 100 python3 docs/results/2026-12-06-fill-drain/timeline.py "$out/timeline" --keep 2 -- $ARGS --repeat 3 \
    --segment-kib 512 --codecs none,fp8,turboquant-4,ans > "$out/timeline.log" 2>&1
  echo "timeline rc=$?"
  tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
  grep -A3 "^== restore" "$out/timeline.log" | head -40
fi
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -m1 "Model name"
VARIANTS="new=." bash docs/results/2026-12-03-host-work/call4.sh "$out/ab" "$rounds" $((limit - SECONDS))
