#!/usr/bin/env bash
# Device call 2: the Manager's GPU tests (the early first batch's among them), the timeline of this tree's
# 512 KiB saves and restores, a line profile of its none save and restore, then ab.sh: base (ab-prev, dc19e20) against this tree, the command, as many
# rounds as fit in LIMIT seconds (../2026-12-03-host-work/call4.sh).
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
HERE=$(dirname "$0")
mkdir -p "$out"
timeout 150 python3 -m pytest -q tests/test_manager_gpu.py > "$out/manager-gpu.txt" 2>&1
echo "manager gpu tests rc=$?"; tail -3 "$out/manager-gpu.txt"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --segment-kib 512"
timeout 120 python3 "$HERE/timeline.py" "$out/timeline" --keep 3 -- $ARGS --repeat 5 --codecs none,turboquant-4,fp8 > "$out/timeline.log" 2>&1
echo "timeline rc=$?"
timeout 140 python3 "$HERE/lines.py" "$out/lines" -- $ARGS --repeat 6 --codecs none > "$out/lines.log" 2>&1
echo "lines rc=$?"
bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$limit"
tar czf "$out/timeline.tgz" -C "$out" timeline timeline.log lines lines.log 2>/dev/null && rm -rf "$out/timeline" "$out/lines"
grep -h "wall\|gap\|==" "$out/timeline.log" | head -60
