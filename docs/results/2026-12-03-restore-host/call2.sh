#!/usr/bin/env bash
# Device call 2: the whole GPU suite on this tree (call 1's three failures were a restore's batch count, now of
# whole chunks), then rounds of ab.sh (base ab-prev = a89c6b3, the command) until TOTAL seconds from the
# start: ../2026-12-03-save-host/call2.sh, which does exactly that.
# Usage, from the repository root after the device prelude: call2.sh OUT ROUNDS TOTAL
exec bash docs/results/2026-12-03-save-host/call2.sh "$@"
