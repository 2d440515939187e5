# One device call: a paired A/B of commit 9167b93's orbitkv_fs/ and gpu/ (new) against 837b2a8's (prev:
# .kvdata/p6.patch reversed), in 16 short rounds alternating prev, new, new, prev, ... so that each pair of
# neighbouring rounds samples about the same stretch of the device's drifting host speed. Each round is
# the pipeline benchmark (codecs round robin, best of 3) at 512 KiB and 4 MiB, 64 MiB workspace.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`. summarize.py reads the logs.
set -u
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
i=0
for code in prev new new prev prev new new prev prev new new prev prev new new prev; do
  i=$((i + 1)); round=$(printf "r%02d-%s" $i $code)
  case $code in prev) patch -s -R -p1 < .kvdata/p6.patch;; esac
  python -c "from orbitkv_fs.provenance import code_identity as c; print('$round', c()['source_sha256'][:12])"
  timeout 40 $B --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  case $code in prev) patch -s -p1 < .kvdata/p6.patch;; esac
done
cd $OUT && tar czf all.tgz r*; rm -rf r[0-9]*
