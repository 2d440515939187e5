#!/bin/bash
# old (4d93400, before this work) and new tier alternating, throughput only, 64 KiB and 1 MiB at QD8/QD32, no fio
cd /work/main
for i in 1 2; do
  (cd /tmp/h4/old && PYTHONPATH=/tmp/h4/old python -m tools.bench_ssd --dir /tmp/h4/scratch --bs 1m 64k --qd 8 32 --size 512m --no-fio --no-latency --json --out /work/main/docs/results/2026-11-29-ssd-3/throughput-old-new/tp-old-$i.json >/dev/null)
  python -m tools.bench_ssd --dir /tmp/h4/scratch --bs 1m 64k --qd 8 32 --size 512m --no-fio --only throughput --json --out /work/main/docs/results/2026-11-29-ssd-3/throughput-old-new/tp-new-$i.json >/dev/null
done
