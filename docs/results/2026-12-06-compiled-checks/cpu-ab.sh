#!/usr/bin/env bash
# The restore's and save's host work on this CPU, the GPU engine's calls no-ops (../2026-12-03-restore-host and
# ../2026-12-03-save-host harnesses), base (the tree before the change) against new (this tree), alternated, five
# pairs each: restore turboquant-4 and none, save turboquant-4 (its gather goes through the compiled places too).
# Usage, from the repository root: cpu-ab.sh BASE_COMMIT > cpu-ab.txt
# JOBS (optional): other jobs, comma-separated, each "save|restore CODEC" (../2026-12-06-compiled-bookkeeping uses it).
set -u
root=$(pwd) base=$1
for v in base new; do
  rm -rf "/tmp/cpu-ab/$v" && mkdir -p "/tmp/cpu-ab/$v" || exit 1
  if [ $v = base ]; then git archive "$base" orbitkv_fs gpu server tools | tar -x -C "/tmp/cpu-ab/$v"
  else cp -r orbitkv_fs gpu server tools "/tmp/cpu-ab/$v/"; fi
  for d in gpu server tools; do mv "/tmp/cpu-ab/$v/$d" "/tmp/cpu-ab/$v/orbitkv_fs/$d"; done
done
R=$root/docs/results
cd /tmp || exit 1
IFS=, read -ra jobs <<< "${JOBS:-restore turboquant-4,restore none,save turboquant-4}"
for job in "${jobs[@]}"; do
  set -- $job
  script=$R/2026-12-03-restore-host/restore_host.py
  [ "$1" = save ] && script=$R/2026-12-03-save-host/save_host.py
  for v in new base new base new base new base new base; do
    echo "$1 $2 $v: $(PYTHONPATH=/tmp/cpu-ab/$v python3 "$script" --codec "$2" --repeat 30 2>&1 | tail -1)"
  done
done
