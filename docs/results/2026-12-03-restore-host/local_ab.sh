#!/usr/bin/env bash
# restore_host.py on base (a tree laid out as the build maps it, on PYTHONPATH) and on the installed tree, ROUNDS
# rounds alternating, for each codec. Usage, from the repository root: local_ab.sh BASE_DIR ROUNDS CODEC...
set -u
base=$1 rounds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
for codec in "$@"; do
  for r in $(seq "$rounds"); do
    echo "base $(cd /tmp && PYTHONPATH=$base python3 "$here/restore_host.py" --codec "$codec" --repeat 40 2>&1 | tail -1)"
    echo "new  $(cd /tmp && python3 "$here/restore_host.py" --codec "$codec" --repeat 40 2>&1 | tail -1)"
  done
done
