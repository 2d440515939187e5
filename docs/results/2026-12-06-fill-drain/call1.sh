#!/usr/bin/env bash
# Device call 1: the timeline of this tree's saves and restores at the geometry (512 KiB and 4 MiB, every
# codec), the fill (host work before the first bulk copy) and drain (GPU and host work after the last) of each.
# Usage, from the repository root after the device prelude: call1.sh OUT
set -u
out=$1
HERE=$(dirname "$0")
mkdir -p "$out"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
timeout 300 python3 "$HERE/timeline.py" "$out/timeline" --keep 2 -- $ARGS --repeat 4 --segment-kib 512,4096 \
  --codecs none,fp8,turboquant-4,ans > "$out/timeline.log" 2>&1
echo "timeline rc=$?"
tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
grep -v "^\s*$" "$out/timeline.log" | grep -A12 "^== " | head -150
