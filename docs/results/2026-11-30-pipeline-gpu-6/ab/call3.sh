# GPU tests on the new code, then old (HEAD eb89552: .kvdata/new6.patch reversed) and new alternating, then budgets.
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py > $OUT/gputests.txt 2>&1; tail -1 $OUT/gputests.txt
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4,ans --block-order shuffled --storage-codec-budget-mib 64"
for round in 1 2; do
  echo "== new$round"; timeout 90 $B --out $OUT/new$round 2>&1 | grep "^| [a-z]"
  patch -s -R -p1 < .kvdata/new6.patch
  echo "== old$round"; timeout 90 $B --out $OUT/old$round 2>&1 | grep "^| [a-z]"
  patch -s -p1 < .kvdata/new6.patch
done
for b in 128 256; do
  echo "== budget$b"; timeout 60 orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib $b --out $OUT/budget$b 2>&1 | grep "^| [a-z]"
done
git diff --stat | tail -1
