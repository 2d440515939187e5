# One device call: the GPU tests on the new code (header templates, msgspec encode items, per-segment
# bound cache, publish_many), then the pipeline benchmark (codecs round robin) in rounds new, prev, prev,
# new (prev: .kvdata/p6.patch reversed, i.e. 837b2a8's orbitkv_fs/ and gpu/).
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py tests/test_gpu_descriptors.py tests/test_connectors_vllm_gpu.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
for round in new1 prev1 prev2 new2; do
  case $round in prev*) patch -s -R -p1 < .kvdata/p6.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 110 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  grep -E "GB/s|x none" $OUT/$round.log | head -20
  case $round in prev*) patch -s -p1 < .kvdata/p6.patch;; esac
done
