#!/usr/bin/env bash
# Exploration on the H200: the same tree with the GPU engine's MAX_BATCH raised to 1024, the Manager's
# --batch-segments 256 against 1024 at 512 KiB, alternating, after one discarded run.
# Usage (device, repository root, after the prelude): bash explore.sh OUT
set -u
out=$1; mkdir -p "$out"
sed -i 's/^MAX_BATCH = 256$/MAX_BATCH = 1024/' gpu/engine.py
grep -n '^MAX_BATCH' gpu/engine.py
args="--device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 256"
cd /tmp
python3 -m orbitkv_fs.tools.bench pipeline $args --batch-segments 1024 > /dev/null 2>&1
for r in 1 2 3; do
  order="256 1024"; [ $((r % 2)) -eq 0 ] && order="1024 256"
  for bs in $order; do
    s=$(date +%s)
    python3 -m orbitkv_fs.tools.bench pipeline $args --batch-segments $bs --out "$out/bs$bs-$r" > "$out/bs$bs-$r.txt" 2>&1
    echo "round $r bs $bs: $(( $(date +%s) - s )) s"; grep -E "^ +(none|fp8|turboquant-4) " "$out/bs$bs-$r.txt"
  done
done
