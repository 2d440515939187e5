#!/usr/bin/env bash
# The prefetch change on this machine (no GPU) with cold arena lines: save_host.py --download (each flight's
# download written before its headers, the fill not counted) and restore_host.py --cold (512 MiB of other
# memory written before each restore), base (a tree laid out as the build maps it, on PYTHONPATH: 85b1520)
# against the installed tree, ROUNDS rounds alternating, `none` and `turboquant-4` at 512 KiB.
# Usage, from the repository root: cold_ab.sh BASE_DIR ROUNDS
set -u
base=$1 rounds=$2
res=$(cd "$(dirname "$0")/.." && pwd)
for codec in none turboquant-4; do
  for r in $(seq "$rounds"); do
    for v in base new; do
      pp=""; [ "$v" = base ] && pp=$base
      echo "$v save    $(cd /tmp && PYTHONPATH=$pp python3 "$res/2026-12-03-save-host/save_host.py" --codec "$codec" --repeat 24 --download 2>&1 | tail -1)"
      echo "$v restore $(cd /tmp && PYTHONPATH=$pp python3 "$res/2026-12-03-restore-host/restore_host.py" --codec "$codec" --repeat 24 --cold 2>&1 | tail -1)"
    done
  done
done
