#!/usr/bin/env bash
# One H200 call: py-spy (sampling, 1 kHz, the Python frames; a CUDA wait spins and shows as the Python line
# that waits) over the pipeline bench's steady state on this tree: 30 repeats of one codec at 512 KiB, per codec.
# Usage, from the repository root after the device prelude (py-spy among the carried wheels): profile.sh OUT CODECS...
set -u
out=$1
shift
mkdir -p "$out/spy"
cd /tmp || exit 1
for c in "$@"; do
  timeout 120 py-spy record -r 1000 -f raw --nonblocking -o "$out/spy/$c-512.txt" -- python3 -m orbitkv_fs.tools.bench \
    pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled \
    --storage-codec-budget-mib 256 --repeat 30 --segment-kib 512 --codecs "$c" --out "$out/spy/run-$c" \
    > "$out/spy/log-$c.txt" 2>&1
  grep "KiB  save" "$out/spy/log-$c.txt"
done
tar -C "$out" -czf "$out/spy.tgz" spy && rm -rf "$out/spy"
