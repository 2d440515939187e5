#!/usr/bin/env bash
# Device call 1: the GPU tests this change touches (the engine's ANS decode as arrays, in place and not; the
# Manager's restore as arrays with ANS; the descriptor tests), then rounds of the command on base
# (ab-prev: e2087be, main before the change) and new, alternating (../2026-12-03-host-work/call4.sh), until
# TOTAL seconds from the start. The tests run first: ab.sh uninstalls the package for its variants.
# Usage, from the repository root after the device prelude: call1.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
(timeout 100 python3 -m pytest -q -rs tests/test_gpu_engine.py -k "ans"
 timeout 150 python3 -m pytest -q -rs tests/test_gpu_descriptors.py \
  "tests/test_manager_gpu.py::test_restore_as_arrays_mixes_runs_and_shuffled_chunks_and_fails_per_chunk" \
  "tests/test_manager_gpu.py::test_shuffled_blocks_over_pipelined_batches") > "$out/gpu-tests.txt" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$out/gpu-tests.txt"
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
