#!/usr/bin/env bash
# One device call: where the host's time goes in the 512 KiB turboquant-4 bench (the command cut to that
# codec and size), sampled by py-spy with native frames (libcuda, numpy) under the Python ones, so that the
# CUDA side of the host's work shows by function. Runs from the repository root after the device prelude, with
# py-spy's wheel among the carried ones. Usage: call.sh OUT [REPEAT]
set -u
here=docs/results/2026-12-06-cuda-host
out=$1 repeat=${2:-30}
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -m1 "Model name"
ARGS="pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled
  --storage-codec-budget-mib 256 --segment-kib 512 --codecs turboquant-4 --repeat $repeat"
for mode in native python; do
  flag=--native; [ $mode = python ] && flag=
  timeout 240 py-spy record $flag --threads --nolineno --rate 997 --format raw -o "$out/tq4-512-$mode.raw" \
    -- python3 -m orbitkv_fs.tools.bench $ARGS > "$out/bench-$mode.log" 2>&1
  echo "py-spy $mode rc=$?"; tail -4 "$out/bench-$mode.log"
  if [ -s "$out/tq4-512-$mode.raw" ]; then
    for root in restore save; do
      python3 $here/fold.py "$out/tq4-512-$mode.raw" $root 45 > "$out/fold-$mode-$root.txt"
      head -25 "$out/fold-$mode-$root.txt"
    done
    gzip -f "$out/tq4-512-$mode.raw"
    break  # native frames came: no need for the Python-only profile
  fi
done
# without a profiler, the same command as the baseline of what sampling costs
timeout 120 python3 -m orbitkv_fs.tools.bench $ARGS > "$out/bench-plain.log" 2>&1
echo "plain rc=$?"; tail -4 "$out/bench-plain.log"
