#!/usr/bin/env bash
# One H200 call: the whole GPU suite on this tree, then ab.sh (../2026-12-02-restore-prefix) with base (ab-prev:
# main before this change, 60be6fc) and new (this tree), ROUNDS rounds of the command (every codec).
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS
set -u
out=$1 rounds=$2
mkdir -p "$out"
timeout 370 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
VARIANTS="base=ab-prev new=." timeout 200 bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
exit 0
