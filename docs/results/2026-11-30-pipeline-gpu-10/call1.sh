# One device call on the current code: the GPU tests, then the round-robin pipeline benchmark at 36 and at
# 80 layers, alternating (each figure with its bound: the codec's stored bytes at the pinned copy's rate),
# then a cProfile of the 512 KiB save and restore. Outputs packed into $OUT/all.tgz after every step.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
pack() { (cd $OUT && tar czf all.tgz --exclude=all.tgz .); }
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py \
  tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py \
  tests/test_gpu_descriptors.py tests/test_connectors_vllm_gpu.py > $OUT/gputests.txt 2>&1
tail -3 $OUT/gputests.txt; pack
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --segment-kib 512,4096 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
i=0
for layers in 36 80 36 80 36 80 36; do
  i=$((i + 1)); round=$(printf "r%02d-L%s" $i $layers)
  timeout 60 $B --layers $layers --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  grep "4096 KiB" $OUT/$round.log; pack
done
timeout 150 python docs/results/2026-11-30-pipeline-gpu-7/prof.py turboquant-4:512:64 none:512:64 > $OUT/prof512.txt 2>&1
grep "^==" $OUT/prof512.txt; pack
