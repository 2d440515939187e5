#!/bin/bash
# The runs of this directory, on the 2-core development machine. Three trees of code, one bench (this
# branch's tools/bench_pipeline.py, copied to BENCH so that each tree's orbitkv_fs is the one imported):
#   main   /work/main (c083d40), its venv
#   before this branch at 77cb2c5 (the Manager split, stage counters added; per-request timers only)
#   after  this branch
# Throughput: three rounds, the trees alternating in each; then data plane and index once per tree
# (PARTS=throughput or PARTS=dataplane runs one of the two).
set -e
PARTS=${PARTS:-throughput,dataplane}
OUT=${OUT:-docs/results/2026-12-02-pipeline-cpu-batch}
BENCH=/tmp/wt24/benchcopy/bench_pipeline_new.py
BEFORE=/tmp/wt24/before-tree          # git archive 77cb2c5 | tar -x -C $BEFORE (see README)
WT=$(pwd)
TP="--device cpu --only throughput --segment-kib 32,4096 --codecs none --layers 8 --blocks 512 --repeat 5"
cp tools/bench_pipeline.py $BENCH
run() {  # tree out-dir args...
  local tree=$1 dir=$2; shift 2
  case $tree in
    main)   (cd /work/main && /work/venv-main/bin/python $BENCH "$@" --out $WT/$OUT/$dir) ;;
    before) (cd $BEFORE && PYTHONPATH=$BEFORE /work/venv-wt24/bin/python $BENCH "$@" --out $WT/$OUT/$dir) ;;
    after)  /work/venv-wt24/bin/orbitkv-bench pipeline "$@" --out $OUT/$dir ;;
  esac
}
if [[ $PARTS == *throughput* ]]; then
  for round in 1 2 3; do
    for tree in main before after; do
      run $tree throughput-$tree-$round $TP > /dev/null
    done
  done
fi
if [[ $PARTS == *dataplane* ]]; then
  for tree in main after; do
    run $tree dataplane-index-$tree --device cpu --only dataplane,index > /dev/null
  done
fi
