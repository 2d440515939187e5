# One device call on the final code: the GPU tests (with the real SmolLM2 K/V sample), the pipeline
# benchmark over every codec at 64 KiB, 512 KiB and 4 MiB segments (codecs round robin), then two more
# alternating rounds new, old against commit 32e734d's orbitkv_fs/ and gpu/ (.kvdata/p4.patch reversed).
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
python -c "from orbitkv_fs.provenance import code_identity as c; print('final', c()['source_sha256'][:12])"
timeout 200 orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 64,512,4096 --repeat 6 --codecs none,fp8,turboquant-4,turboquant-3,ans --block-order shuffled --storage-codec-budget-mib 64 --out $OUT/final > $OUT/final.log 2>&1 || echo "final failed"
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
for round in new4 old4 new5 old5; do
  case $round in old*) patch -s -R -p1 < .kvdata/p4.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 100 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $round in old*) patch -s -p1 < .kvdata/p4.patch;; esac
done
uptime
cd $OUT && tar czf rounds.tgz new* old* && rm -rf new* old*
