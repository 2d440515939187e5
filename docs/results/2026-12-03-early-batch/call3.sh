#!/usr/bin/env bash
# Device call 3: the whole GPU suite on this tree, then more rounds of ab.sh (base ab-prev = dc19e20 against this
# tree, the command: ../2026-12-03-host-work/call4.sh) in the LIMIT seconds left. The suite runs first:
# ab.sh uninstalls the package for its variants.
# Usage, from the repository root after the device prelude: call3.sh OUT ROUNDS LIMIT
set -u
out=$1 rounds=$2 limit=$3
mkdir -p "$out"
timeout 330 python3 -m pytest -q -m gpu tests/ > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$?"; tail -3 "$out/gpu-suite.txt"
bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$limit"
exit 0
