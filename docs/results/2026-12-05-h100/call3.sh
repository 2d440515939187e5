#!/usr/bin/env bash
# Device call 3 of 2026-12-05 (sixth stop): the Manager's GPU tests on this tree (two early restore batches),
# then ab.sh with base (ab-prev: d76fd05, main before the change) and new (this tree), the command,
# as many rounds as fit in LIMIT seconds, then the timeline (timeline.py) of this tree's turboquant-4 restores
# at 512 KiB.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
HERE=$(dirname "$0")
mkdir -p "$out"
timeout 150 python3 -m pytest -q tests/test_manager_gpu.py tests/test_restore_batch.py > "$out/manager-gpu.txt" 2>&1
echo "manager gpu tests rc=$?"; tail -3 "$out/manager-gpu.txt"; grep -E "^(FAILED|ERROR)" "$out/manager-gpu.txt" | head
bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$limit"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
timeout 60 python3 "$HERE/timeline.py" "$out/timeline" --keep 3 -- $ARGS --repeat 5 --segment-kib 512 \
  --codecs turboquant-4 > "$out/timeline.log" 2>&1
echo "timeline rc=$?"
gzip "$out/timeline/timeline.json" 2>/dev/null
grep -E "^==|wall|gap " "$out/timeline.log" | head -40
