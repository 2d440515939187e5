#!/usr/bin/env bash
# One H200 call: ab.sh (../2026-12-02-restore-prefix) with base (ab-prev: main before this stop, 1053e30) and new
# (this tree), ROUNDS rounds of the command; then the whole GPU suite on this tree; then, with CODECS,
# py-spy over this tree's saves and restores at 512 KiB (profile.sh).
# Usage, from the repository root after the device prelude: device.sh OUT ROUNDS [CODECS...]
set -u
out=$1 rounds=$2
shift 2
prev=docs/results/2026-12-02-restore-prefix
mkdir -p "$out"
VARIANTS="base=ab-prev new=." timeout 200 bash $prev/ab.sh "$out" "$rounds" --device gpu --only throughput \
  --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --repeat 3 --segment-kib 512,4096 \
  --codecs none,fp8,turboquant-4,ans
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1  # ab.sh uninstalled it
timeout 420 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rs > "$out/gpu-suite.txt" 2>&1
tail -3 "$out/gpu-suite.txt"
[ $# -gt 0 ] && PYTHONPATH=/tmp/ab/new:$PYTHONPATH timeout 200 bash $prev/profile.sh "$out" "$@"
exit 0
