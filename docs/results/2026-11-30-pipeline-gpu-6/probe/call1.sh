# GPU tests on C (two streams + coded batching), then the GPU-time probe on C, B (two streams), A (HEAD).
P=docs/results/2026-11-30-pipeline-gpu-6/gputime.py
S="none:4096:64 fp8:4096:64 turboquant-4:4096:64 none:512:64"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py 2>&1 | tail -4
echo "#### C" | tee -a $OUT/probe.txt; timeout 100 python $P $S 2>&1 | grep -v "KiB  save" | tee -a $OUT/probe.txt
patch -s -R -p1 < .kvdata/batch.patch
echo "#### B" | tee -a $OUT/probe.txt; timeout 100 python $P $S 2>&1 | grep -v "KiB  save" | tee -a $OUT/probe.txt
patch -s -R -p1 < .kvdata/engine.patch
echo "#### A" | tee -a $OUT/probe.txt; timeout 100 python $P $S 2>&1 | grep -v "KiB  save" | tee -a $OUT/probe.txt
patch -s -p1 < .kvdata/engine.patch; patch -s -p1 < .kvdata/batch.patch
git diff --stat | tail -1
