#!/usr/bin/env bash
# Device call 2: the GPU suite on this tree, its timeline (512 KiB, every codec), then ab.sh: base (ab-prev, main
# before the change: 93074d1) against this tree, the command, as many rounds as fit in LIMIT seconds.
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
HERE=$(dirname "$0")
mkdir -p "$out"
timeout 240 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
timeout 90 python3 "$HERE/timeline.py" "$out/timeline" --keep 2 -- $ARGS --repeat 3 --segment-kib 512 \
  --codecs none,fp8,turboquant-4,ans > "$out/timeline.log" 2>&1
echo "timeline rc=$?"
tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
grep -A3 "^== restore" "$out/timeline.log" | head -40
VARIANTS="base=ab-prev new=." bash docs/results/2026-12-03-host-work/call4.sh "$out/ab" "$rounds" "$limit"
