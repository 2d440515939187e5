# One device call: the cohort benchmark (serving, vLLM-shaped engine, 256-token chunks = 512 KiB segments,
# codec fp8) on commit 75ea436 (batch_segments 256, "new") and on the same tree with the default at 64
# (.kvdata/bs64.patch applied, "prev"), in the order prev, new (a second call after call3.sh, same code). Each run has its own recompute
# control on the same requests.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
set -u
mkdir -p $OUT/cohort
C="orbitkv-bench cohort --requests 32 --warm-requests 24 --prefixes 6 --concurrency 4 --codecs fp8 --variants dram --no-plots --no-smollm2 --chunk-tokens 256"
for round in c5-prev c6-new; do
  case $round in *prev) patch -s -p1 < .kvdata/bs64.patch;; esac
  python -c "from orbitkv_fs.manager import ManagerConfig as M; print('$round batch_segments', M().batch_segments)"
  timeout 130 $C --out $OUT/cohort/$round > $OUT/cohort/$round.log 2>&1 || echo "$round failed"
  grep -E "^\| (control|dram)" $OUT/cohort/$round.log
  case $round in *prev) patch -s -R -p1 < .kvdata/bs64.patch;; esac
  (cd $OUT && tar czf all.tgz cohort)
done
