#!/usr/bin/env bash
# One H200 call: the GPU engine and kernel tests on this tree, then ab.sh (../2026-12-02-restore-prefix) with
# base (ab-prev: main before this change, 66127de), new (this tree: ANS rounds, a quarter of the half workspace
# for chunk buffers) and the same tree with an eighth (s8) and a half (s2), ROUNDS rounds of the command
# with the codecs this change touches (none, ans).
# Usage, from the repository root after the device prelude: device.sh OUT ROUNDS
set -u
out=$1 rounds=$2
mkdir -p "$out"
timeout 240 python3 -m pytest -q -x -m gpu tests/test_gpu_engine.py tests/test_gpu_kernels.py > "$out/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.txt"
VARIANTS="base=ab-prev new=. s8=ab-s8 s2=ab-s2" timeout 300 bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" \
  "$rounds" --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled \
  --storage-codec-budget-mib 256 --repeat 3 --segment-kib 512,4096 --codecs none,ans
exit 0
