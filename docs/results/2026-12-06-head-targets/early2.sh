#!/usr/bin/env bash
# Device call for the second early batch: the named GPU tests on this tree, the timeline of its 512 KiB
# restores (TIMELINE=1), then ab.sh: base (ab-prev: bb25414, one early batch) against this tree, the issue's
# command, as many rounds as fit in what is left of LIMIT seconds from the script's start.
# Usage, from the repository root after the device prelude: [TIMELINE=1] early2.sh OUT LIMIT TEST_PATHS...
set -u
out=$1 limit=$2
shift 2
mkdir -p "$out"
if [ $# -gt 0 ]; then
  timeout 300 python3 -m pytest -q -m gpu "$@" > "$out/gpu-tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.txt"
fi
if [ "${TIMELINE:-0}" = 1 ]; then
  ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256"
  timeout 100 python3 docs/results/2026-12-06-fill-drain/timeline.py "$out/timeline" --keep 2 -- $ARGS --repeat 3 \
    --segment-kib 512,4096 --codecs none,turboquant-4 > "$out/timeline.log" 2>&1
  echo "timeline rc=$?"
  tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
  grep -A3 "^== restore" "$out/timeline.log" | head -40
fi
VARIANTS="base=ab-prev new=." bash docs/results/2026-12-03-host-work/call4.sh "$out/ab" 40 $((limit - SECONDS))
