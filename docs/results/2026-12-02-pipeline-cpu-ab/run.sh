#!/usr/bin/env bash
# CPU A/B of `orbitkv-bench pipeline` on the 2-core development machine: the previous stop's main (385478c,
# BASE_TREE) against this tree, each laid out as the build maps it and imported through PYTHONPATH by one
# Python (a local editable install is a path at the end of sys.path, so PYTHONPATH wins: checked below).
# Throughput rounds alternate the order; then the data plane and index figures once per tree. Python runs
# from /tmp: the current directory is first on sys.path and would import the checkout.
set -eu
BASE_TREE=${BASE_TREE:-ab-base}
PY=${PY:-python3}
ROOT=$(pwd)
OUT=$ROOT/${OUT:-docs/results/2026-12-02-pipeline-cpu-ab}
ROUNDS=${ROUNDS:-3}
TP="--device cpu --only throughput --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 --repeat 5"
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/"
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d"; done
}
lay_out "$ROOT/$BASE_TREE" /tmp/abcpu/base
lay_out "$ROOT" /tmp/abcpu/new
cd /tmp
for v in base new; do
  PYTHONPATH=/tmp/abcpu/$v $PY -c "import orbitkv_fs.manager.save as m; assert m.__file__.startswith('/tmp/abcpu/$v/'), m.__file__"
done
for r in $(seq 1 "$ROUNDS"); do
  order="base new"; [ $((r % 2)) -eq 0 ] && order="new base"
  for v in $order; do
    PYTHONPATH=/tmp/abcpu/$v $PY -m orbitkv_fs.tools.bench pipeline $TP --out "$OUT/throughput-$v-$r" > /dev/null
  done
done
for v in base new; do
  PYTHONPATH=/tmp/abcpu/$v $PY -m orbitkv_fs.tools.bench pipeline --device cpu --only dataplane,index \
    --out "$OUT/dataplane-index-$v" > /dev/null
done
