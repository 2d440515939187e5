#!/usr/bin/env bash
# engine_host.py on two trees, alternating: "base" (a checkout of the previous main) and "new" (this tree),
# each laid out as the installed package (gpu/, server/, tools/ under orbitkv_fs/), ROUNDS rounds per codec.
# Needs cupy importable (CUPY_SITE: a pip --target folder holding cupy and no numpy of its own).
# Usage, from the repository root: engine_ab.sh BASE_TREE ROUNDS > out.txt
set -eu
root=$(pwd) base=$1 rounds=$2
for t in base new; do
  src=$root; [ "$t" = base ] && src=$root/$base
  rm -rf "/tmp/engine-ab/$t" && mkdir -p "/tmp/engine-ab/$t" && cp -r "$src/orbitkv_fs" "/tmp/engine-ab/$t/"
  for d in gpu server tools; do cp -r "$src/$d" "/tmp/engine-ab/$t/orbitkv_fs/$d"; done
done
cd /tmp
for codec in none fp8 turboquant-4; do
  for r in $(seq 1 "$rounds"); do
    for t in base new; do
      echo "== $codec round $r $t"
      PYTHONPATH=/tmp/engine-ab/$t:${CUPY_SITE:-/tmp/cupy-site} python "$root/docs/results/2026-12-02-gpu-host/engine_host.py" \
        --codec "$codec" --repeat 300 | tail -4
    done
  done
done
