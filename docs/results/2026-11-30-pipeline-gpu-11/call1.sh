# One device call: the GPU tests on commit 61951f6 (three batches in flight), then a paired A/B of its
# orbitkv_fs/, gpu/, server/ and tools/ (new) against bdab6d3's (prev: .kvdata/p11.patch reversed, two in
# flight), in 16 short rounds alternating prev, new, new, prev, ... so that neighbouring rounds sample about
# the same stretch of the device's drifting host speed. Each round is the pipeline benchmark (codecs round
# robin, best of 3) at 512 KiB and 4 MiB, 36 layers, 64 MiB workspace.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
# Summary: python docs/results/2026-11-30-pipeline-gpu-9/summarize.py docs/results/2026-11-30-pipeline-gpu-11/ab
set -u
mkdir -p $OUT/ab
pack() { (cd $OUT && tar czf all.tgz gputests.txt ab); }
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py \
  tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py \
  tests/test_gpu_descriptors.py tests/test_connectors_vllm_gpu.py > $OUT/gputests.txt 2>&1
tail -3 $OUT/gputests.txt; grep -E "^(FAILED|ERROR)" $OUT/gputests.txt | head; pack
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
i=0
for code in prev new new prev prev new new prev prev new new prev prev new new prev; do
  i=$((i + 1)); round=$(printf "r%02d-%s" $i $code)
  case $code in prev) patch -s -R -p1 < .kvdata/p11.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 40 $B --out $OUT/ab/$round > $OUT/ab/$round.log 2>&1 || echo "$round failed"
  grep "4096 KiB" $OUT/ab/$round.log | grep -v "^|" | cut -c1-75
  case $code in prev) patch -s -p1 < .kvdata/p11.patch;; esac
  pack
done
