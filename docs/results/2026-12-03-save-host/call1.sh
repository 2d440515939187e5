#!/usr/bin/env bash
# Device call 1: the whole GPU suite on main's HEAD (00d169d: restore.py changed after the last suite run), then
# a warm line profile of the save and restore batch steps per codec (lines_warm.py), the command at 512 KiB.
# Usage, from the repository root after the device prelude: call1.sh OUT
set -u
out=$1
mkdir -p "$out"
timeout 330 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
for codec in turboquant-4 none; do
  timeout 120 python3 docs/results/2026-12-03-save-host/lines_warm.py "$out/lines-$codec" -- --device gpu --only throughput \
    --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --repeat 5 --segment-kib 512 \
    --codecs "$codec" > "$out/lines-$codec.log" 2>&1
  echo "lines $codec rc=$?"
done
tar -C "$out" -czf "$out/lines.tgz" lines-turboquant-4 lines-none && rm -rf "$out/lines-turboquant-4" "$out/lines-none"
exit 0
