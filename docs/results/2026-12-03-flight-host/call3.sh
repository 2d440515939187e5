#!/usr/bin/env bash
# One H200 call: ../2026-12-03-host-work/call4.sh (ab.sh, base ab-prev = 23f7747 against this tree, the issue's
# command, as many rounds as fit in LIMIT seconds), then the whole GPU suite on this tree. ab.sh uninstalls the
# package for its variants: the suite run here could not import it and was run again after the device prelude.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS LIMIT
set -u
out=$1
bash docs/results/2026-12-03-host-work/call4.sh "$@"
timeout 365 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
exit 0
