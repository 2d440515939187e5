# Isolating A/B, same machine: new (HEAD), C (HEAD with the old batch-closing rule), old (df685da); twice.
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 4096 --repeat 6 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
for round in 1 2; do
  echo "== new $round"; $B --out $OUT/new$round 2>&1 | grep "^| [a-z]" | cut -c1-60
  patch -s -p0 < .kvdata/c.patch
  echo "== C $round"; $B --out $OUT/c$round 2>&1 | grep "^| [a-z]" | cut -c1-60
  patch -s -R -p0 < .kvdata/c.patch
  patch -s -R -p1 < .kvdata/new.patch
  echo "== old $round"; $B --out $OUT/old$round 2>&1 | grep "^| [a-z]" | cut -c1-60
  patch -s -p1 < .kvdata/new.patch
done
