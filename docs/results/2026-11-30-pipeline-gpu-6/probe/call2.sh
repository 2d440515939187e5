P=docs/results/2026-11-30-pipeline-gpu-6/gputime.py
timeout 220 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
echo "#### new" | tee -a $OUT/probe.txt
timeout 100 python -W ignore $P none:4096:64 fp8:4096:64 turboquant-4:4096:64 2>&1 | grep -v "KiB  save" >> $OUT/probe.txt
mkdir -p $OUT/prof
timeout 150 python -W ignore .kvdata/prof8.py fp8,none 4096,512 $OUT/prof 64 > $OUT/prof.txt 2>&1
grep "^==" $OUT/prof.txt
