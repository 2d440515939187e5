#!/bin/bash
# Probe of the current code (commit in commit.txt): where the host's time goes at 4 MiB segments.
source .device-prelude.sh >/dev/null 2>&1
P=docs/results/2026-11-30-pipeline-gpu-7
timeout 200 python $P/hostphases.py --freeze turboquant-4:4096:64 fp8:4096:64 none:4096:64 > $OUT/hostphases.txt 2>&1
timeout 250 python $P/prof.py turboquant-4:4096:64 fp8:4096:64 > $OUT/prof.txt 2>&1
tail -50 $OUT/hostphases.txt
grep "^==" $OUT/prof.txt
