#!/usr/bin/env bash
# Issue 24's CPU target (`none` at 32 KiB at least 0.65 of its 4 MiB rate in the same run), base against new,
# alternated: the bench on trees laid out as cpu-ab.sh lays them (/tmp/cpu-ab/{base,new}), from /tmp.
# Usage: ab.sh PAIRS OUT_DIR; then ratios.py OUT_DIR > ratios.md
set -u
pairs=$1 out=$2
mkdir -p "$out"
cd /tmp || exit 1
for i in $(seq "$pairs"); do
  order="new base"; [ $((i % 2)) = 0 ] && order="base new"
  for v in $order; do
    PYTHONPATH=/tmp/cpu-ab/$v python3 -m orbitkv_fs.tools.bench pipeline --device cpu --only throughput \
      --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 --repeat 5 --out "$out/$v-$i" > /dev/null 2>&1
    echo "pair $i $v rc=$?"
  done
done
