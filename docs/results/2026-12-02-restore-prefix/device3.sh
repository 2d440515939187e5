#!/usr/bin/env bash
# One H200 call: the GPU tests of the engine, the Manager and the direct SSD path and the engine's host-side
# tests on this tree, then ab.sh with four trees: base (ab-prev, bd1da13), prefix (ab-head, 5e08177: the
# restore prefix as arrays), place (ab-place: + the worker's double-ended workspace placement) and new (this
# tree: + the ramped batches), ROUNDS rounds of every codec at 512 KiB and 4 MiB.
# Usage, from the repository root after the device prelude: device3.sh OUT ROUNDS
set -u
out=$1 rounds=$2
mkdir -p "$out"
timeout 170 python -m pytest -q tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py \
  tests/test_gpu_place_host.py tests/test_gpu_descriptors.py tests/test_gpu_ans_host.py -p no:cacheprovider -rs \
  > "$out/gpu-tests.txt" 2>&1
tail -3 "$out/gpu-tests.txt"
VARIANTS="base=ab-prev prefix=ab-head place=ab-place new=." timeout 380 bash docs/results/2026-12-02-restore-prefix/ab.sh \
  "$out" "$rounds" --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled \
  --storage-codec-budget-mib 256 --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
