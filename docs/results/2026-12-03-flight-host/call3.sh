#!/usr/bin/env bash
# One H200 call: ab.sh (../2026-12-02-restore-prefix) with base (ab-prev: main before this change, 23f7747) and
# new (this tree), as many rounds of the command (every codec, 512 KiB and 4 MiB) as fit in LIMIT
# seconds (the rounds run so far kept), then the whole GPU suite on this tree.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
mkdir -p "$out"
VARIANTS="base=ab-prev new=." timeout "$limit" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
[ -d "$out/runs" ] && tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
timeout 365 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
exit 0
