# One device call: the Manager's batch_segments at 64 (the default, "prev") against 256 (the GPU engine's
# MAX_BATCH, "new"), in 12 short rounds alternating prev, new, new, prev, ... At 512 KiB and 1 MiB segments
# a compressing codec's batch is capped by batch_segments, not by the workspace (64 segments of 512 KiB are
# 8.6 MB of TurboQuant-4 output against a 31 MB share), so each call runs 2-4x as many batches as the
# workspace would allow. Same code in every round. Each round: the pipeline benchmark (codecs round robin,
# best of 3), 36 layers, 64 MiB workspace.
# Run from the repository root after `source .device-prelude.sh` and
# `export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz`.
# Summary: python docs/results/2026-11-30-pipeline-gpu-9/summarize.py docs/results/2026-11-30-batch-segments/ab
set -u
mkdir -p $OUT/ab
B="orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 512,1024 --repeat 3 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64"
i=0
for n in 64 256 256 64 64 256 256 64 64 256 256 64; do
  i=$((i + 1)); round=$(printf "r%02d-%s" $i $([ $n = 64 ] && echo prev || echo new))
  timeout 40 $B --batch-segments $n --out $OUT/ab/$round > $OUT/ab/$round.log 2>&1 || echo "$round failed"
  grep "512 KiB" $OUT/ab/$round.log | grep -v "^|" | cut -c1-75
  (cd $OUT && tar czf all.tgz ab)
done
