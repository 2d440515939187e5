#!/usr/bin/env bash
# The pipeline bench with `none` and `ans` at the GPU workspace budget the bench uses (256 MiB) and at 1 GiB,
# alternating, two runs each: does a larger `ans` batch move its save? Usage (device, after the prelude): budget.sh OUT
set -u
out=$1; mkdir -p $out
cd /tmp
for b in 256 1024 256 1024; do
  i=$((${i:-0} + 1))
  timeout 60 python3 -m orbitkv_fs.tools.bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib $b --repeat 3 --segment-kib 512,4096 --codecs none,ans --out $out/b$b-$i > $out/b$b-$i.txt 2>&1
  echo "== budget $b MiB (run $i)"; grep "KiB  save" $out/b$b-$i.txt
done
