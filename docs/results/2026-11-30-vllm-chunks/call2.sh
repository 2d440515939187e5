#!/bin/bash
# Device call 2: the serving cohort (Qwen3-8B shape, random weights, DRAM only, codec none) with one block
# per chunk (16 tokens: what the vLLM connector stored before) and 16 blocks per chunk (256 tokens: its
# default now), same cohort, one after the other on one H200.
source .device-prelude.sh >/dev/null 2>&1
git rev-parse HEAD > $OUT/commit.txt 2>&1
R="--requests 32 --warm-requests 24 --prefixes 6 --concurrency 4 --codecs none --variants dram --no-plots --no-smollm2"
for c in 16 256; do
  timeout 270 orbitkv-bench cohort $R --chunk-tokens $c --out $OUT/chunk$c > $OUT/chunk$c.log 2>&1
  echo "chunk $c rc $?"; grep -A12 "^| " $OUT/chunk$c/cohort.md | head -14
done
