#!/usr/bin/env bash
# One H200 call: ab.sh (../2026-12-02-restore-prefix) with three trees, ROUNDS rounds of the command at
# 512 KiB: base (ab-prev: main before this stop, 1053e30), s1 (ab-s1: base + the publish on arrays: index.py,
# tiers/dram.py, tiers/eviction.py of this stop and save.py handing publish_many its arrays) and new (this tree:
# + the save batches as columns); then py-spy over this tree at 512 KiB (CODECS).
# Usage, from the repository root after the device prelude: device2.sh OUT ROUNDS [CODECS...]
set -u
out=$1 rounds=$2
shift 2
prev=docs/results/2026-12-02-restore-prefix
mkdir -p "$out"
VARIANTS="base=ab-prev s1=ab-s1 new=." timeout 300 bash $prev/ab.sh "$out" "$rounds" --device gpu --only throughput \
  --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --repeat 3 --segment-kib 512 \
  --codecs none,fp8,turboquant-4,ans
[ $# -gt 0 ] && PYTHONPATH=/tmp/ab/new:$PYTHONPATH timeout 150 bash $prev/profile.sh "$out" "$@"
exit 0
