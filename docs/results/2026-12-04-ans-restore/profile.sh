#!/usr/bin/env bash
# Device call: where a 512 KiB restore's host CPU goes, `ans` against `none`. py-spy samples the bench's
# threads on CPU only (idle threads are not sampled; a CUDA wait spins, so it is sampled) at 1000 Hz without
# stopping the process, Python frames only (native unwinding at 997 Hz fell minutes behind the run), while it
# runs the command for one codec at 512 KiB. Each run in its own process group, killed whole at its limit.
# Usage, from the repository root after the device prelude: profile.sh OUT
set -u
out=$1
mkdir -p "$out"
args=(pipeline --device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled
      --storage-codec-budget-mib 256 --segment-kib 512)
for c in ans none; do
  timeout -s KILL 150 setsid py-spy record --nonblocking --rate ${RATE:-1000} --format raw -o "$out/spy-$c.txt" -- \
    orbitkv-bench "${args[@]}" --codecs "$c" --repeat ${REPEAT:-60} --out "$out/bench-$c" > "$out/spy-$c.log" 2>&1
  echo "spy $c rc=$?"
  pkill -9 -f orbitkv-bench; sleep 1
done
exit 0
