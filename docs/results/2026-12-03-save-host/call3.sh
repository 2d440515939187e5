#!/usr/bin/env bash
# Device call 3: the direct-SSD GPU test (the one call 2's suite failed: its batches no longer split a chunk),
# then more rounds of ab.sh (base ab-prev = 00d169d against this tree, the command) until TOTAL seconds.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
timeout 120 python3 -m pytest -q -m gpu tests/test_ssd_direct_gpu.py -rs > "$out/ssd-direct-gpu.txt" 2>&1
echo "ssd direct gpu rc=$?"; tail -2 "$out/ssd-direct-gpu.txt"
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
