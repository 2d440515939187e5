#!/usr/bin/env bash
# The issue's CPU target, A/B: RUNS rounds, each one run of the CPU bench with the tree at BASE (a directory
# holding a source tree of the base commit, gpu/, server/ and tools/ moved under orbitkv_fs/ as setup.py maps
# them) and one with this checkout, alternating, so that both sample the same stretches of a shared machine.
# Each run: `none` at 32 KiB and 4 MiB, 8 layers, 512 blocks, best of 5 repeats (the issue's CPU command).
# Usage: ab.sh BASE OUT [RUNS]; then summary.py OUT.
set -u
base=$1 out=$2 runs=${3:-12}
here=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"
cd /tmp  # not the checkout: PYTHONPATH alone picks the tree
for i in $(seq 1 "$runs"); do
  for t in base new; do
    if [ "$t" = base ]; then tree=$base; else tree=$here; fi
    PYTHONPATH=$tree python3 -m orbitkv_fs.tools.bench pipeline --device cpu --only throughput --segment-kib 32,4096 \
      --codecs none --layers 8 --blocks 512 --repeat 5 --out "$out/$t-$i" > "$out/$t-$i.log" 2>&1 \
      || { echo "run $t $i failed"; tail -5 "$out/$t-$i.log"; exit 1; }
  done
done
