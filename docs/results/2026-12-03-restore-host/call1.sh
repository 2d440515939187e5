#!/usr/bin/env bash
# Device call 1: the whole GPU suite on this tree (slowest tests listed), then wall-clock stage timers of an `ans`
# 512 KiB save and restore (../2026-12-02-pipeline-host-cuts/stage_timers.py) on base (ab-prev = a89c6b3, main
# before this change) and this tree, then rounds of ab.sh (the command: ../2026-12-03-host-work/call4.sh)
# until TOTAL seconds from the start. The suite runs first: ab.sh uninstalls the package for its variants.
# Usage, from the repository root after the device prelude: call1.sh OUT ROUNDS TOTAL
set -u
out=$1 rounds=$2 total=$3
start=$(date +%s)
root=$(pwd)
mkdir -p "$out"
timeout 430 python3 -m pytest -q -m gpu tests/ -rs --durations=25 > "$out/gpu-suite.txt" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/gpu-suite.txt" | tail -3
timers=$root/docs/results/2026-12-02-pipeline-host-cuts/stage_timers.py
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1  # each tree from PYTHONPATH, not the editable install
for v in base new; do
  dir=$root/ab-prev; [ "$v" = new ] && dir=$root
  rm -rf "/tmp/st/$v" && mkdir -p "/tmp/st/$v" && cp -r "$dir/orbitkv_fs" "/tmp/st/$v/" \
    && for d in gpu server tools; do cp -r "$dir/$d" "/tmp/st/$v/orbitkv_fs/$d"; done
  (cd /tmp && PYTHONPATH=/tmp/st/$v:$PYTHONPATH python3 -c "import orbitkv_fs.gpu.engine as e; print(e.__file__)" \
    && PYTHONPATH=/tmp/st/$v:$PYTHONPATH timeout 90 python3 "$timers" "$out/timers-ans-512-$v.txt" --device gpu \
    --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256 --repeat 5 \
    --segment-kib 512 --codecs ans > "$out/timers-ans-512-$v.log" 2>&1)
  echo "timers $v rc=$?"
done
left=$(( total - ($(date +%s) - start) ))
[ "$left" -gt 60 ] && bash docs/results/2026-12-03-host-work/call4.sh "$out" "$rounds" "$left"
exit 0
