#!/usr/bin/env bash
# One H200 call: ab.sh (../2026-12-02-restore-prefix) with base (ab-prev: main before this change, 60be6fc), new
# (this tree: codec batches of two engine flights) and new1024 (ab-s1024: this tree with batch_segments 1024),
# ROUNDS rounds of the command (every codec, 512 KiB and 4 MiB).
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS
set -u
out=$1 rounds=$2
VARIANTS="base=ab-prev new=. new1024=ab-s1024" timeout 540 bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
exit 0
