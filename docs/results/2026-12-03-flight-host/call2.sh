#!/usr/bin/env bash
# One H200 call: the pipeline bench's steady-state profile (--profile: cProfile around the saves and restores
# of the repeats after the first) at 512 KiB, one codec per run; profile_calls.py reads the .prof files.
# Usage, from the repository root after the device prelude: call2.sh OUT REPEAT CODECS...
set -u
out=$1 repeat=$2
shift 2
mkdir -p "$out"
for c in "$@"; do
  timeout 120 python3 -m orbitkv_fs.tools.bench pipeline --device gpu --only throughput --blocks 512 --layers 36 \
    --block-order shuffled --storage-codec-budget-mib 256 --repeat "$repeat" --segment-kib 512 --codecs "$c" \
    --profile --out "$out/$c" > "$out/log-$c.txt" 2>&1
  grep "KiB  save" "$out/log-$c.txt"
  rm -f "$out/$c"/*.txt
done
exit 0
