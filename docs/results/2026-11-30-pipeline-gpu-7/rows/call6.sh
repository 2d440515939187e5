# One device call: the GPU tests (and the descriptor-row tests) on the code with descriptor rows packed
# straight into the upload buffer, then the pipeline benchmark (codecs round robin) in rounds new, prev,
# new, prev (prev: .kvdata/p5.patch reversed, i.e. b69424b's orbitkv_fs/ and gpu/).
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_gpu_descriptors.py 2>&1 | tail -1
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
for round in rows1 prev1 rows2 prev2; do
  case $round in prev*) patch -s -R -p1 < .kvdata/p5.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 100 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $round in prev*) patch -s -p1 < .kvdata/p5.patch;; esac
done
cd $OUT && tar czf rounds.tgz rows* prev* && rm -rf rows1 rows2 prev1 prev2 rows*.log prev*.log
