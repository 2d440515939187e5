# One device call: the GPU tests on commit 9167b93 (the save changes of call 1 plus the restore's header
# templates and decode plans), then the pipeline benchmark (codecs round robin) in rounds new, prev, prev,
# new at the default 64 MiB codec workspace and two rounds of the new code at 256 MiB (prev:
# .kvdata/p6.patch reversed, i.e. 837b2a8's orbitkv_fs/ and gpu/), then the cohort benchmark once per code.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py tests/test_gpu_descriptors.py tests/test_connectors_vllm_gpu.py > $OUT/gputests.txt 2>&1; tail -2 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled"
for round in new1 prev1 ws256a prev2 new2 ws256b; do
  case $round in prev*) patch -s -R -p1 < .kvdata/p6.patch;; esac
  case $round in ws256*) mib=256;; *) mib=64;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 110 $B --storage-codec-budget-mib $mib --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  grep -E "GB/s" $OUT/$round.log | head -6
  case $round in prev*) patch -s -p1 < .kvdata/p6.patch;; esac
done
C="orbitkv-bench cohort --requests 32 --warm-requests 24 --prefixes 6 --concurrency 4 --codecs none --variants dram --no-plots --no-smollm2 --chunk-tokens 256"
for round in cnew cprev; do
  case $round in cprev) patch -s -R -p1 < .kvdata/p6.patch;; esac
  timeout 150 $C --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  tail -15 $OUT/$round.log
  case $round in cprev) patch -s -p1 < .kvdata/p6.patch;; esac
done
cd $OUT && tar czf all.tgz *.log new1 new2 prev1 prev2 ws256a ws256b cnew cprev 2>/dev/null; ls
