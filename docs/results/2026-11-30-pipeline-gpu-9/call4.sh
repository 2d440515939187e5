# One device call: commit 9167b93's code only, the codec workspace (--storage-codec-budget) at 64 MiB (the
# default) against 256 MiB, in short rounds alternating 64, 256, 256, 64, ... (best of 3 per round, 4 MiB
# and 512 KiB segments). The outputs are packed after every round (the call may run out of device time).
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`. summarize.py reads the logs (ws64 as "prev").
set -u
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,4096 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled"
i=0
for mib in 64 256 256 64 64 256 256 64 64 256 256 64; do
  i=$((i + 1)); round=$(printf "r%02d-%s" $i $([ $mib = 64 ] && echo prev || echo new))
  timeout 30 $B --storage-codec-budget-mib $mib --out $OUT/$round > $OUT/$round.log 2>&1 || echo "$round failed"
  (cd $OUT && tar czf all.tgz r*.log)
done
