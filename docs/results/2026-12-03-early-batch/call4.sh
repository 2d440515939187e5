#!/usr/bin/env bash
# Device call 4: ../2026-12-03-host-work/call4.sh with this tree ("new", batch_segments 512 by default) against the
# same tree with batch_segments 1024 by default (ab-s1024), the command, as many rounds as fit in LIMIT
# seconds. Usage, from the repository root after the device prelude: call4.sh OUT ROUNDS LIMIT
VARIANTS="new=. new1024=ab-s1024" exec bash docs/results/2026-12-03-host-work/call4.sh "$@"
