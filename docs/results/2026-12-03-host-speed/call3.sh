#!/usr/bin/env bash
# Device call 3: the GPU suite on this tree (save headers written by numba), but for the `ans` quick cohort
# (118 s of bench, whose save path the other GPU tests cover), then rounds of ab.sh (base ab-prev = 7b5ea2e,
# main before this change, same bench; new = this tree; the command: ../2026-12-03-host-work/call4.sh)
# until TOTAL seconds from the start. The suite runs first: ab.sh uninstalls the package for its variants.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
cmp -s tools/bench_pipeline.py ab-prev/tools/bench_pipeline.py || { echo "ab-prev has another bench"; exit 1; }
timeout 340 python3 -m pytest -q -m gpu tests/ -rs --durations=10 \
  --deselect "tests/test_bench_cohort.py::test_quick_cohort_on_gpu[ans]" > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 40 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
