# One device call: the GPU tests on the new code, then the pipeline benchmark new, old, new, old (old: the
# new code with .kvdata/p1.patch reversed, i.e. commit 32e734d's orbitkv_fs/ and gpu/), then the host-phase
# probe on the new code. Run from the repository root after `source .device-prelude.sh`.
set -u
R=docs/results/2026-11-30-pipeline-gpu-7
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4,ans --block-order shuffled --storage-codec-budget-mib 64"
for round in new1 old1 new2 old2; do
  case $round in old*) patch -s -R -p1 < .kvdata/p1.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 120 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $round in old*) patch -s -p1 < .kvdata/p1.patch;; esac
done
(cd $R && timeout 150 python -W ignore hostphases.py none:4096:64 fp8:4096:64 turboquant-4:4096:64 none:512:64 fp8:512:64 2>&1 | grep -v "KiB  save") > $OUT/hostphases-new.txt
cd $OUT && tar czf rounds.tgz new1* old1* new2* old2* && rm -rf new1* old1* new2* old2*
