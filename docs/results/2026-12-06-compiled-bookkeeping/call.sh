#!/usr/bin/env bash
# Device calls for the compiled save and restore bookkeeping, from the repository root after the device prelude,
# with the tree before the change laid out in ab-prev/ (git archive 8384bb1 orbitkv_fs gpu server tools).
#   call.sh OUT gpu LIMIT:           the GPU tests of the files this change's code runs in, then paired rounds of
#                                    every codec at 512 KiB in the time left
#   call.sh OUT gpuslow LIMIT [N]:   the same tests in half of LIMIT, then the slowed-host rounds in the rest
#   call.sh OUT ab|issue|slow ...:   as ../2026-12-06-compiled-checks/call.sh, which runs every round here
set -u
out=$1 what=$2 limit=$3 burners=${4:-16}
rounds=docs/results/2026-12-06-compiled-checks/call.sh
t0=$(date +%s)
case $what in
  gpu|gpuslow)
    mkdir -p "$out"
    share=7; [ "$what" = gpuslow ] && share=5
    timeout $((limit * share / 10)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_manager_gpu.py \
      tests/test_restore_batch.py tests/test_gather_scatter.py tests/test_gpu_headers.py \
      tests/test_gpu_descriptors.py tests/test_gpu_engine.py tests/test_gpu_kernels.py \
      tests/test_connectors_vllm_gpu.py \
      tests/test_ssd_direct_gpu.py tests/test_connectors_staging.py tests/test_bench_cohort.py \
      > "$out/gpu-tests.txt" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.txt"
    rest=$((limit - ($(date +%s) - t0)))
    if [ "$what" = gpu ]; then exec bash "$rounds" "$out" ab "$rest"; fi
    exec bash "$rounds" "$out" slow "$rest" "$burners" ;;
  *) exec bash "$rounds" "$@" ;;
esac
