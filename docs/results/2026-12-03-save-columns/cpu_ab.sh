#!/usr/bin/env bash
# CPU A/B on this machine: the issue's CPU command (`none`, 32 KiB and 4 MiB segments, 8 layers) on two trees laid
# out as the build maps them (orbitkv_fs/ with gpu/, server/, tools/ inside), ROUNDS rounds, the order alternating.
# Usage: BASE=DIR NEW=DIR cpu_ab.sh OUT ROUNDS   (python: $PYTHON, default python3)
set -u
out=$(mkdir -p "$1" && cd "$1" && pwd) rounds=$2
for r in $(seq 1 "$rounds"); do
  for v in base new; do
    [ $((r % 2)) = 0 ] && v=$([ $v = base ] && echo new || echo base)
    t=$BASE; [ $v = new ] && t=$NEW
    (cd /tmp && PYTHONPATH=$t ${PYTHON:-python3} -m orbitkv_fs.tools.bench pipeline --device cpu --only throughput \
      --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 --repeat 5 --out "$out/$v-$r" > "$out/$v-$r.txt" 2>&1)
    echo "$v-$r: $(grep 'KiB  save' "$out/$v-$r.txt" | tr -s ' ' | tr '\n' '|')"
  done
done
