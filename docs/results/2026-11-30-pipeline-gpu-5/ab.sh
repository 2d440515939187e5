# A/B in one call, same machine, alternating: HEAD (new), df685da (old: .kvdata/new.patch reversed), new, old.
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,fp8,turboquant-4,ans --block-order shuffled --storage-codec-budget-mib 64"
for round in 1 2; do
  $B --out $OUT/new$round 2>&1 | grep "^| [a-z]"
  patch -s -R -p1 < .kvdata/new.patch
  $B --out $OUT/old$round 2>&1 | grep "^| [a-z]"
  patch -s -p1 < .kvdata/new.patch
done
