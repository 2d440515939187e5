#!/bin/bash
# Alternating rounds of pressure_ssd.py: the base tree (BASE, laid out as the package: a `git archive` of the
# commit with gpu/, server/ and tools/ moved under orbitkv_fs/) and this checkout, the order swapped every
# round. Usage: bash ab.sh BASE OUT ROUNDS
set -euo pipefail
base=$1 out=$2 rounds=$3
here=$(cd "$(dirname "$0")" && pwd)
new=$(cd "$here/../../.." && pwd)
mkdir -p "$out"
cd /tmp
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then order="base new"; else order="new base"; fi
  for t in $order; do
    if [ "$t" = base ]; then tree=$base; else tree=$new; fi
    echo "round $r $t"
    PYTHONPATH=$tree python "$here/pressure_ssd.py" --json "$out/r$r-$t.json" fresh pressure ssd ssd:s3fifo
  done
done
