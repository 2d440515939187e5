#!/usr/bin/env bash
# Device call 2: the Manager's GPU tests (call 1's three failures: a restore's batch count, now of whole chunks),
# a warm line profile of an `ans` 512 KiB restore on this tree (lines_restore.py), then rounds of ab.sh (base
# ab-prev = a89c6b3; ../2026-12-03-host-work/call4.sh, the command) until TOTAL seconds from the start.
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
timeout 150 python3 -m pytest -q -m gpu tests/test_manager_gpu.py -rs > "$out/manager-gpu.txt" 2>&1
echo "manager gpu rc=$?"; tail -2 "$out/manager-gpu.txt"
(cd /tmp && timeout 150 python3 "$OLDPWD/docs/results/2026-12-03-restore-host/lines_restore.py" "$out/lines-ans" -- \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512 --codecs ans > "$out/lines-ans.log" 2>&1)
echo "lines ans rc=$?"
[ -f "$out/lines-ans/lines.txt" ] && cp "$out/lines-ans/lines.txt" "$out/lines-ans.txt"
rm -rf "$out/lines-ans"
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
