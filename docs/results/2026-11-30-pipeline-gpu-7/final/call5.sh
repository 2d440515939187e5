# ans alone, new, old, new, old (old: commit 32e734d's orbitkv_fs/ and gpu/, .kvdata/p4.patch reversed):
# the final run's ans save (17.6 GB/s at 4 MiB) was below earlier calls' figures.
set -u
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 6 --codecs none,ans --block-order shuffled --storage-codec-budget-mib 64"
for round in ansnew1 ansold1 ansnew2 ansold2; do
  case $round in *old*) patch -s -R -p1 < .kvdata/p4.patch;; esac
  timeout 100 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $round in *old*) patch -s -p1 < .kvdata/p4.patch;; esac
done
cd $OUT && tar czf ans.tgz ans* && rm -rf ansnew* ansold*
