#!/usr/bin/env bash
# Device call 3: more rounds of ab.sh (base ab-prev = a89c6b3 against this tree, the command;
# ../2026-12-03-host-work/call4.sh) for LIMIT seconds: call 2's rounds caught a host whose probe moved 1.8x.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS LIMIT
set -u
bash docs/results/2026-12-03-host-work/call4.sh "$@"
