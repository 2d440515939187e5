#!/usr/bin/env bash
# One H200 call: ab.sh (../2026-12-02-restore-prefix) with base (ab-prev: here 60be6fc; main before the change
# measured, 23f7747, in ../2026-12-03-flight-host/call3.sh) and new (this tree), as many
# rounds of the command (every codec, 512 KiB and 4 MiB) as fit in LIMIT seconds; the rounds run so far
# are kept when the limit cuts the last one. VARIANTS (ab.sh's) names other trees to compare.
# Usage, from the repository root after the device prelude: call4.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
mkdir -p "$out"
VARIANTS="${VARIANTS:-base=ab-prev new=.}" timeout "$limit" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
[ -d "$out/runs" ] && tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
exit 0
