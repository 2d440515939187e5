#!/bin/bash
# Latency, old (4d93400, the code before this work) and new (working tree) alternating, same minutes.
# Run under: flock /tmp/bench.lock; the old tree from: git archive 4d93400 | tar -x -C /tmp/h4/old
set -e
R=/work/main/docs/results/2026-11-29-ssd-3
for i in 1 2; do
  (cd /tmp/h4/old && PYTHONPATH=/tmp/h4/old python -m tools.bench_ssd --dir /tmp/h4/scratch --bs 1m --qd 32 --size 64m --no-fio --json --out $R/old-4d93400/latency-$i.json >/dev/null)
  (cd /work/main && orbitkv-bench ssd --only latency --latency-repeat 1 --json --out $R/latency-$i.json >/dev/null)
done
