#!/usr/bin/env bash
# On the H200 (after the device prelude): GPU timelines and host timers of `ans` and `none` at 4 MiB and
# 512 KiB, one process per codec and size. Usage: bash trace_ans.sh OUT_DIR
set -u
out=$1; here=$(cd "$(dirname "$0")" && pwd); mkdir -p "$out"
args="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --repeat 3"
cd /tmp
for kib in 4096 512; do
  for codec in ans none; do
    d="$out/trace-$codec-$kib"; mkdir -p "$d"
    python "$here/gpu_trace.py" "$d" $args --segment-kib $kib --codecs $codec > "$d/bench.txt" 2>&1
    rm -f "$d/trace.json"
    python "$here/../2026-12-02-pipeline-host-cuts/stage_timers.py" "$out/timers-$codec-$kib.txt" $args \
      --segment-kib $kib --codecs $codec > /dev/null 2>&1
  done
done
