#!/usr/bin/env bash
# One H200 call: the GPU tests of the engine and the Manager on this tree, py-spy profiles of the bench's host
# thread (turboquant-4 and none at 512 KiB, this tree), then ab3.sh: base (BASE_TREE) against new (this tree),
# ROUNDS alternating rounds of every codec at 512 KiB and 4 MiB.
# Usage, from the repository root after the device prelude: device.sh BASE_TREE OUT ROUNDS
set -u
root=$(pwd) base=$1 out=$2 rounds=$3
mkdir -p "$out/spy"
timeout 120 python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py -p no:cacheprovider -rs \
  > "$out/gpu-tests.txt" 2>&1
tail -3 "$out/gpu-tests.txt"
args=(--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256)
for c in turboquant-4 none; do
  (cd /tmp && timeout 60 py-spy record -r 1000 -f raw -t --nonblocking -o "$out/spy/$c-512.txt" -- \
    python3 -m orbitkv_fs.tools.bench pipeline "${args[@]}" --repeat 4 --segment-kib 512 --codecs $c \
    --out "$out/spy/run-$c" > "$out/spy/log-$c.txt" 2>&1)
  grep "KiB  save" "$out/spy/log-$c.txt"
done
tar -C "$out" -czf "$out/spy.tgz" spy && rm -rf "$out/spy"
VARIANTS="base new" timeout 340 bash "$root/docs/results/2026-12-02-batch-1024/ab3.sh" "$base" "$out" "$rounds" "${args[@]}" \
  --repeat 3 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans
