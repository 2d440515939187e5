#!/usr/bin/env bash
# One H200 call: the whole GPU suite on this tree, then py-spy (1 kHz, raw) over the pipeline bench's steady
# state, 60 repeats of one codec at 512 KiB, per codec.
# Usage, from the repository root after the device prelude (py-spy among the carried wheels): call1.sh OUT CODECS...
# SUITE_TIMEOUT: seconds the GPU suite may take (default 290; ../2026-12-03-flight-host ran it with 420).
set -u
out=$1
shift
mkdir -p "$out/spy"
timeout "${SUITE_TIMEOUT:-290}" python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
cd /tmp || exit 1
for c in "$@"; do
  timeout 80 py-spy record -r 1000 -f raw --nonblocking -o "$out/spy/$c-512.txt" -- python3 -m orbitkv_fs.tools.bench \
    pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled \
    --storage-codec-budget-mib 256 --repeat 60 --segment-kib 512 --codecs "$c" --out "$out/spy/run-$c" \
    > "$out/spy/log-$c.txt" 2>&1
  grep "KiB  save" "$out/spy/log-$c.txt"
done
tar -C "$out" -czf "$out/spy.tgz" spy && rm -rf "$out/spy"
exit 0
