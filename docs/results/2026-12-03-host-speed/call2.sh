#!/usr/bin/env bash
# Device call 2: rounds of ab.sh (base ab-prev = a89c6b3, main before the restore-host change, with this tree's
# bench_pipeline.py copied in: the bench's code is the same in both trees, now with a host probe before each
# call; new = this tree), the command (../2026-12-03-host-work/call4.sh), for LIMIT seconds.
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS LIMIT
set -u
cmp -s tools/bench_pipeline.py ab-prev/tools/bench_pipeline.py || { echo "ab-prev lacks this bench"; exit 1; }
bash docs/results/2026-12-03-host-work/call4.sh "$@"
