#!/usr/bin/env bash
# One H200 call: the engine's GPU tests, per-batch timers of `ans` at 512 KiB and 4 MiB on this tree, then
# three rounds alternating this tree (new) and BASE_TREE (base) of the pipeline bench with `none` and `ans`.
# Usage, from the repository root after the device prelude: device.sh BASE_TREE OUT
set -u
root=$(pwd) base=$root/$1 out=$2
mkdir -p "$out/runs"
timeout 120 python -m pytest -q -m gpu tests/test_gpu_engine.py -p no:cacheprovider -rs > "$out/gpu-tests.txt" 2>&1
tail -2 "$out/gpu-tests.txt"
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/" || return 1
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d" || return 1; done
}
lay_out "$base" /tmp/ab/base && lay_out "$root" /tmp/ab/new || exit 1
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
cd /tmp
args=(--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256
      --repeat 3)
for kib in 512 4096; do
  PYTHONPATH=/tmp/ab/new${PYTHONPATH:+:$PYTHONPATH} timeout 60 python3 \
    "$root/docs/results/2026-12-02-pipeline-host-cuts/stage_timers.py" "$out/timers-ans-$kib.txt" "${args[@]}" \
    --segment-kib $kib --codecs ans --out "$out/timers-run-$kib" > "$out/timers-log-$kib.txt" 2>&1
  grep -E "KiB  save|fetch|_packed_slots" "$out/timers-log-$kib.txt"
done
r=0
for v in new base base new new base; do
  r=$((r + 1)); n=$(( (r + 1) / 2 ))
  PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} timeout 50 python3 -m orbitkv_fs.tools.bench pipeline "${args[@]}" \
    --segment-kib 512,4096 --codecs none,ans --out "$out/runs/$v-$n" > "$out/runs/$v-$n.txt" 2>&1
  echo "== $v-$n"; grep "KiB  save" "$out/runs/$v-$n.txt"
done
