#!/usr/bin/env bash
# Device call 1: the whole GPU suite on this tree (slowest tests listed; the kernels changed: okv_ans_pack leaves
# each ANS header's slot, okv_write_headers writes ANS headers), then rounds of the command on base
# (ab-prev: cd114c5) and new (../2026-12-03-host-work/call4.sh) until TOTAL seconds from the start.
# Usage, from the repository root after the device prelude: call1.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
mkdir -p "$out"
timeout 470 python3 -m pytest -q -m gpu tests/ -rs --durations=10 > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu-suite.txt" | head -20
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
