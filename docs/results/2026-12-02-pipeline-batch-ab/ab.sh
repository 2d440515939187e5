#!/usr/bin/env bash
# A/B of `orbitkv-bench pipeline` between two trees in one machine session, rounds alternating the order.
# Usage, from the repository root (the "new" tree):
#   ab.sh BASE_TREE OUT ROUNDS BENCH_ARGS...
# BASE_TREE: a checkout of the baseline (e.g. `git archive 385478c | tar -x -C ab-base`). Each tree is laid
# out as the build maps it (orbitkv_fs/, with gpu/, server/, tools/ inside) and imported through PYTHONPATH,
# so both run in the same Python with the same wheels; only the package differs.
set -u
root=$(pwd)
base=$root/$1 out=$2 rounds=$3
shift 3
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/" || return 1
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d" || return 1; done
}
lay_out "$base" /tmp/ab/base && lay_out "$root" /tmp/ab/new || exit 1
# Python runs from /tmp: with `-m` or `-c` the current directory comes first on sys.path (the checkout).
mkdir -p "$out" && out=$(cd "$out" && pwd) && cd /tmp || exit 1
# An editable install of the project would win over PYTHONPATH (its finder answers first): remove it, and
# check that each variant imports its own copy.
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
for v in base new; do
  PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} python3 -c "import orbitkv_fs.manager.save as m, orbitkv_fs.gpu.engine as e
assert m.__file__.startswith('/tmp/ab/$v/') and e.__file__.startswith('/tmp/ab/$v/'), (m.__file__, e.__file__)" || exit 1
done
# One discarded run first: the machine's first minute runs slower (seen: 15-30 GB/s, then 43-48, same code).
PYTHONPATH=/tmp/ab/new${PYTHONPATH:+:$PYTHONPATH} python3 -m orbitkv_fs.tools.bench pipeline "$@" > /dev/null 2>&1
for r in $(seq 1 "$rounds"); do
  order="base new"
  [ $((r % 2)) -eq 0 ] && order="new base"
  for v in $order; do
    PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} python3 -m orbitkv_fs.tools.bench pipeline "$@" \
      --out "$out/$v-$r" > "$out/$v-$r.txt" 2>&1 || echo "round $r $v failed: see $out/$v-$r.txt"
    echo "round $r $v: $(grep -c 'KiB  save' "$out/$v-$r.txt") rows"
  done
done
