#!/usr/bin/env bash
# One H200 call: turboquant-4 at 512 KiB alone, the issue's geometry, with the Manager's batch_segments at 512
# (default), 384 and 256, ROUNDS rounds rotating their order: does a finer restore batch let the GPU's work of
# one batch overlap more of the next's (its restore stays at 0.76 of the bound while its host work is 2.4-2.8 us
# a segment)? Usage, from the repository root after the device prelude: call4.sh OUT ROUNDS
set -u
out=$1 rounds=$2
mkdir -p "$out/runs"
sizes=(512 384 256)
for r in $(seq 1 "$rounds"); do
  for i in 0 1 2; do
    b=${sizes[$(( (i + r) % 3 ))]}
    python3 -m orbitkv_fs.tools.bench pipeline --device gpu --only throughput --blocks 512 --layers 36 \
      --block-order shuffled --storage-codec-budget-mib 256 --repeat 3 --segment-kib 512 --codecs turboquant-4 \
      --batch-segments "$b" --out "$out/runs/b$b-$r" > "$out/runs/b$b-$r.txt" 2>&1
    echo "round $r b$b: $(grep 'KiB  save' "$out/runs/b$b-$r.txt")"
  done
done
tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
exit 0
