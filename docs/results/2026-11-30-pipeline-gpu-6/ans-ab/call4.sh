timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -1 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,ans --block-order shuffled --storage-codec-budget-mib 64"
for round in 1 2; do
  echo "== new$round"; timeout 90 $B --out $OUT/ans-new$round 2>&1 | grep "^| [a-z]"
  patch -s -R -p1 < .kvdata/new6.patch
  echo "== old$round"; timeout 90 $B --out $OUT/ans-old$round 2>&1 | grep "^| [a-z]"
  patch -s -p1 < .kvdata/new6.patch
done
git diff --stat | tail -1
cd $OUT && tar czf call4.tgz ans-* gputests.txt && rm -rf ans-*
