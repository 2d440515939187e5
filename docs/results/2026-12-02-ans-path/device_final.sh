#!/usr/bin/env bash
# One H200 call: the GPU tests of the engine, the Manager and the direct SSD path, then one run of each tree
# (this one first: its kernels compile in that run) of the pipeline bench, every codec at 512 KiB and 4 MiB.
# Usage, from the repository root after the device prelude: device_final.sh BASE_TREE OUT
set -u
root=$(pwd) base=$root/$1 out=$2
mkdir -p "$out/runs"
timeout 140 python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py tests/test_ssd_direct_gpu.py \
  -p no:cacheprovider -rs > "$out/gpu-tests.txt" 2>&1
tail -6 "$out/gpu-tests.txt"
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/" || return 1
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d" || return 1; done
}
lay_out "$base" /tmp/ab/base && lay_out "$root" /tmp/ab/new || exit 1
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
cd /tmp
for v in new base; do
  PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} timeout 40 python3 -m orbitkv_fs.tools.bench pipeline --device gpu --only throughput --blocks 512 \
    --layers 36 --segment-kib 512,4096 --codecs none,fp8,turboquant-4,ans --block-order shuffled \
    --storage-codec-budget-mib 256 --repeat 3 --out "$out/runs/$v-1" > "$out/runs-$v.txt" 2>&1
  grep "KiB  save" "$out/runs-$v.txt"
done
