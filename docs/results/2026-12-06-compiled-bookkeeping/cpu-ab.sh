#!/usr/bin/env bash
# The save's and restore's host work on this CPU, the GPU engine's calls no-ops: the harness runs of
# ../2026-12-06-compiled-checks/cpu-ab.sh (base against new, alternated, five pairs each) with the jobs
# save turboquant-4 and none, restore turboquant-4 and none.
# Usage, from the repository root: cpu-ab.sh BASE_COMMIT > cpu-ab.txt; python3 ../2026-12-06-compiled-checks/cpu_ab.py
JOBS="save turboquant-4,save none,restore turboquant-4,restore none" \
  exec bash "$(dirname "$0")/../2026-12-06-compiled-checks/cpu-ab.sh" "$@"
