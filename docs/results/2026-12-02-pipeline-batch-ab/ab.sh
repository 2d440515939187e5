#!/usr/bin/env bash
# A/B of `orbitkv-bench pipeline` between two trees in one machine session, rounds alternating the order.
# Usage, from the repository root (the "new" tree):
#   ab.sh BASE_TREE OUT ROUNDS BENCH_ARGS...
# BASE_TREE: a checkout of the baseline (e.g. `git archive 385478c | tar -x -C ab-base`). Each tree is laid
# out as the build maps it (orbitkv_fs/, with gpu/, server/, tools/ inside) and imported through PYTHONPATH,
# so both run in the same Python with the same wheels; only the package differs.
set -u
base=$1 out=$2 rounds=$3
shift 3
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/" || return 1
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d" || return 1; done
}
lay_out "$base" /tmp/ab/base && lay_out . /tmp/ab/new || exit 1
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  order="base new"
  [ $((r % 2)) -eq 0 ] && order="new base"
  for v in $order; do
    PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} python3 -m orbitkv_fs.tools.bench pipeline "$@" \
      --out "$out/$v-$r" > "$out/$v-$r.txt" 2>&1 || echo "round $r $v failed: see $out/$v-$r.txt"
    echo "round $r $v: $(grep -c 'KiB  save' "$out/$v-$r.txt") rows"
  done
done
