#!/usr/bin/env bash
# Device calls 1 and 2: the whole GPU suite on this tree, then rounds of ab.sh (base = ab-prev, new = this tree;
# the command: ../2026-12-03-host-work/call4.sh) until TOTAL seconds from the start. The suite runs
# first: ab.sh uninstalls the package for its variants.
# Call 1: this tree 85b1520 (the numba header writer and its bounds checks, which the H200 had not run in full),
#         ab-prev 7b5ea2e (main before the header writer).
# Call 2: this tree 24fb74a (the arena's header and ANS table lines prefetched), ab-prev 85b1520.
# Usage, from the repository root after the device prelude: call1.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
cmp -s tools/bench_pipeline.py ab-prev/tools/bench_pipeline.py || { echo "ab-prev has another bench"; exit 1; }
timeout 450 python3 -m pytest -q -m gpu tests/ -rs --durations=10 > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 40 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
