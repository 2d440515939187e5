#!/usr/bin/env bash
# Device call 1: the whole GPU suite on this tree (the last stop changed eviction, which the GPU path shares,
# and the staging pool's size classes), then py-spy (1 kHz, raw) over the pipeline bench's steady state (40 repeats) at
# 512 KiB, one codec at a time, as ../2026-12-03-host-work/call1.sh. Also tests/test_bytes_every_cpu.py on
# the GPU host's CPU.
# Usage, from the repository root after the device prelude: call1.sh OUT SPY_SECONDS CODECS...
set -u
out=$1 spy=$2
shift 2
mkdir -p "$out/spy"
start=$(date +%s)
timeout 430 python3 -m pytest -q -m gpu tests/ -rs --durations=10 > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu-suite.txt" | head -20
# Bytes on this host's CPU (an Intel Xeon; the development and CI machines are AMD EPYC): the golden segments
# under every numpy dispatch level and numba target it can run.
timeout 50 python3 -m pytest -q tests/test_bytes_every_cpu.py > "$out/bytes-every-cpu.txt" 2>&1
echo "bytes on every CPU rc=$?"; tail -1 "$out/bytes-every-cpu.txt"
cd /tmp || exit 1
for c in "$@"; do
  timeout -s INT "$spy" py-spy record -r 1000 -f raw --nonblocking -o "$out/spy/$c-512.txt" -- python3 -m orbitkv_fs.tools.bench \
    pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled \
    --storage-codec-budget-mib 256 --repeat 40 --segment-kib 512 --codecs "$c" --out "$out/spy/run-$c" \
    > "$out/spy/log-$c.txt" 2>&1
  grep "KiB  save" "$out/spy/log-$c.txt"
done
tar -C "$out" -czf "$out/spy.tgz" spy && rm -rf "$out/spy"
exit 0
