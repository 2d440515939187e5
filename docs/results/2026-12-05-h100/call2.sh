#!/usr/bin/env bash
# Device call 2 of 2026-12-05 (sixth stop): the timeline (timeline.py) of this tree's turboquant-4 and fp8 saves
# and restores at 512 KiB and 4 MiB, the last three of five repeats each.
# Usage, from the repository root after the device prelude: call2.sh OUT
set -u
out=$1
HERE=$(dirname "$0")
mkdir -p "$out"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
timeout 200 python3 "$HERE/timeline.py" "$out/timeline" --keep 3 -- $ARGS --repeat 5 --segment-kib 512,4096 \
  --codecs none,turboquant-4,fp8 > "$out/timeline.log" 2>&1
echo "timeline rc=$?"
cp "$out/timeline/timeline.txt" "$out/timeline.txt" 2>/dev/null
gzip "$out/timeline/timeline.json" 2>/dev/null
grep -E "^==|wall|gap " "$out/timeline.log" | head -120
