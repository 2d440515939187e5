#!/usr/bin/env bash
# One H200 call: the GPU tests of the engine and the Manager on this tree, then ab.sh with three trees: base
# (ab-prev: main before this change), mid (ab-mid: the restore prefix as arrays, no ramp) and new (this tree:
# the prefix as arrays and the ramped batches), ROUNDS rounds of every codec at 512 KiB and 4 MiB.
# Usage, from the repository root after the device prelude: device.sh OUT ROUNDS
set -u
out=$1 rounds=$2
mkdir -p "$out"
timeout 150 python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py \
  -p no:cacheprovider -rs > "$out/gpu-tests.txt" 2>&1
tail -3 "$out/gpu-tests.txt"
VARIANTS="base=ab-prev mid=ab-mid new=." timeout 400 bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" "$rounds" \
  --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
