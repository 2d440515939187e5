#!/usr/bin/env bash
# Device call 3: a warm line profile of an `ans` 512 KiB restore on this tree (lines_restore.py: where its time
# goes, the restore worker's waits on the GPU among it), then rounds of ab.sh (base ab-prev = a89c6b3) until
# TOTAL seconds from the start. Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
root=$(pwd)
mkdir -p "$out"
(cd /tmp && timeout 150 python3 "$root/docs/results/2026-12-03-restore-host/lines_restore.py" "$out/lines-ans" -- \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512 --codecs ans > "$out/lines-ans.log" 2>&1)
echo "lines ans rc=$?"
[ -f "$out/lines-ans/lines.txt" ] && cp "$out/lines-ans/lines.txt" "$out/lines-ans.txt"
rm -rf "$out/lines-ans"
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
