# One device call: the GPU tests on the new code (with the real SmolLM2 K/V sample), then the pipeline
# benchmark (codecs round robin) in alternating rounds new, old, new, old, new, old (old: .kvdata/p3.patch reversed, i.e.
# commit 32e734d's orbitkv_fs/ and gpu/; tools/ is the new one in every round, so both freeze the heap).
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
for round in new1 old1 new2 old2 new3 old3; do
  case $round in old*) patch -s -R -p1 < .kvdata/p3.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 100 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $round in old*) patch -s -p1 < .kvdata/p3.patch;; esac
done
uptime
cd $OUT && tar czf rounds.tgz new* old* && rm -rf new* old*
