#!/usr/bin/env bash
# One H200 call on the final tree: profile.sh (py-spy, 30 repeats, per codec at 512 KiB), then ab.sh base
# (ab-prev: main before this change) against new (this tree), ROUNDS rounds of every codec at 512 KiB.
# Usage, from the repository root after the device prelude: device2.sh OUT ROUNDS
set -u
out=$1 rounds=$2
bash docs/results/2026-12-02-restore-prefix/profile.sh "$out" turboquant-4 none
VARIANTS="base=ab-prev new=." timeout 300 bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512 --codecs none,fp8,turboquant-4,ans
