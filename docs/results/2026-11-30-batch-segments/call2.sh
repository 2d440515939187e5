# One device call on the final code (commit 06ca2d3, batch_segments 256 by default): the eight GPU test
# files, then 6 rounds of the round-robin pipeline benchmark at its defaults, 36 layers, 512 KiB and 4 MiB.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
# Summary: python docs/results/2026-11-30-pipeline-gpu-10/summarize.py docs/results/2026-11-30-batch-segments/final
set -u
mkdir -p $OUT/final
pack() { (cd $OUT && tar czf all.tgz final); }
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py \
  tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py \
  tests/test_gpu_descriptors.py tests/test_connectors_vllm_gpu.py > $OUT/final/gputests.txt 2>&1
tail -3 $OUT/final/gputests.txt; grep -E "^(FAILED|ERROR)" $OUT/final/gputests.txt | head; pack
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled"
for i in 1 2 3 4 5 6; do
  round=r0$i-L36
  timeout 40 $B --out $OUT/final/$round > $OUT/final/$round.log 2>&1 || echo "$round failed"
  grep -E "(512|4096) KiB" $OUT/final/$round.log | grep -v "^|" | cut -c1-75
  pack
done
