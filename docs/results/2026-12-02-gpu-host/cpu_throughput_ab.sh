#!/usr/bin/env bash
# The throughput part of ../2026-12-02-pipeline-cpu-ab/run.sh alone (no data plane, no index): `none` at 32 KiB and
# 4 MiB on the CPU path, the previous main (BASE_TREE) against this tree, ROUNDS rounds alternating the order.
# Usage, from the repository root: BASE_TREE=ab-prev OUT=DIR ROUNDS=3 PY=python cpu_throughput_ab.sh
set -eu
BASE_TREE=${BASE_TREE:-ab-prev} PY=${PY:-python3} ROOT=$(pwd) ROUNDS=${ROUNDS:-3}
OUT=$ROOT/${OUT:-docs/results/2026-12-02-gpu-host/cpu-ab-2}
TP="--device cpu --only throughput --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 --repeat 5"
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/"
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d"; done
}
lay_out "$ROOT/$BASE_TREE" /tmp/abcpu/base
lay_out "$ROOT" /tmp/abcpu/new
cd /tmp
for r in $(seq 1 "$ROUNDS"); do
  order="base new"; [ $((r % 2)) -eq 0 ] && order="new base"
  for v in $order; do
    PYTHONPATH=/tmp/abcpu/$v $PY -m orbitkv_fs.tools.bench pipeline $TP --out "$OUT/throughput-$v-$r" > /dev/null
  done
done
