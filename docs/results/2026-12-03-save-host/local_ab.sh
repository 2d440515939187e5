#!/usr/bin/env bash
# save_host.py (or the harness HARNESS names, with its arguments) on base (a tree laid out as the build maps it,
# on PYTHONPATH) and on the installed tree, ROUNDS rounds alternating, for each codec.
# Usage, from the repository root: [HARNESS=PATH] local_ab.sh BASE_DIR ROUNDS CODEC...
set -u
base=$1 rounds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
harness=${HARNESS:-$here/save_host.py}
for codec in "$@"; do
  for r in $(seq "$rounds"); do
    echo "base $(cd /tmp && PYTHONPATH=$base python3 "$harness" --codec "$codec" --repeat 40 2>&1 | tail -1)"
    echo "new  $(cd /tmp && python3 "$harness" --codec "$codec" --repeat 40 2>&1 | tail -1)"
  done
done
