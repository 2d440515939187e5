#!/usr/bin/env bash
# Device call 4: ab.sh with this tree ("new", batch_segments 512 by default) against the same tree with
# batch_segments 1024 by default (ab-s1024), the command, as many rounds as fit in LIMIT seconds.
# Usage, from the repository root after the device prelude: call4.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
mkdir -p "$out"
VARIANTS="new=. new1024=ab-s1024" timeout "$limit" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
[ -d "$out/runs" ] && tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
exit 0
