#!/usr/bin/env bash
# Device calls for the compiled save and restore bookkeeping, from the repository root after the device prelude,
# with the tree before the change laid out in ab-prev/ (git archive 8384bb1 orbitkv_fs gpu server tools).
#   call.sh OUT gpu LIMIT:   the GPU tests of the files this change's code runs in, then paired rounds in the time left
#   call.sh OUT gpuslow LIMIT [N]: the same GPU tests in half of LIMIT, then the slow rounds below in the rest
#   call.sh OUT ab LIMIT:    paired rounds only
#   call.sh OUT issue LIMIT: the issue's command (every codec, 512 KiB and 4 MiB) on this tree alone
#   call.sh OUT slow LIMIT [N]: paired rounds of turboquant-4 at 512 KiB alone while N (default 16) copies of
#                               burn.py (niced) load the host's memory and caches: a slowed lent host, on purpose
# Paired rounds: ../2026-12-02-restore-prefix/ab.sh, base (ab-prev) against new (this tree), the issue's command
# cut to 512 KiB (every codec, --repeat 3), rounds rotating the order, as many as LIMIT seconds allow.
set -u
out=$1 what=$2 limit=$3 burners=${4:-16}
mkdir -p "$out"
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -m1 "Model name"
args=(--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256
      --repeat 3)
if [ "$what" = gpu ] || [ "$what" = gpuslow ]; then
  share=7; [ "$what" = gpuslow ] && share=5
  timeout $((limit * share / 10)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_manager_gpu.py \
    tests/test_restore_batch.py tests/test_gather_scatter.py tests/test_gpu_headers.py tests/test_gpu_descriptors.py \
    tests/test_gpu_engine.py tests/test_gpu_kernels.py tests/test_connectors_vllm_gpu.py tests/test_ssd_direct_gpu.py \
    tests/test_connectors_staging.py tests/test_bench_cohort.py > "$out/gpu-tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.txt"
fi
left=$((limit - ($(date +%s) - t0) - 15))
if [ "$what" = slow ] || [ "$what" = gpuslow ]; then
  pids=()
  for _ in $(seq "$burners"); do nice -n 10 python3 docs/results/2026-12-06-compiled-checks/burn.py & pids+=($!); done
  VARIANTS="base=ab-prev new=." timeout "$left" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" 40 \
    "${args[@]}" --segment-kib 512 --codecs turboquant-4
  kill "${pids[@]}"
elif [ "$what" = issue ]; then
  VARIANTS="new=." timeout "$left" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" 9 "${args[@]}" \
    --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
elif [ "$left" -gt 60 ]; then
  VARIANTS="base=ab-prev new=." timeout "$left" bash docs/results/2026-12-02-restore-prefix/ab.sh "$out" 20 \
    "${args[@]}" --segment-kib 512 --codecs none,fp8,turboquant-4,ans
fi
[ -d "$out/runs" ] && tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
exit 0
