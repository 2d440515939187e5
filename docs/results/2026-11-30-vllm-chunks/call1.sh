#!/bin/bash
# Device call 1: the GPU tests on this code, then the pipeline at one block (32 KiB) and 16 blocks
# (512 KiB) per chunk, Qwen3-8B geometry (8 KV heads x 128, 16-token blocks, 36 layers), shuffled blocks.
set -x
source .device-prelude.sh >/dev/null 2>&1
export ORBITKV_REAL_KV=$PWD/.kvdata/smollm2_kv_sample.npz
git rev-parse HEAD > $OUT/commit.txt 2>&1; git status --short >> $OUT/commit.txt 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_manager_gpu.py \
  tests/test_ssd_direct_gpu.py tests/test_ssd_cufile.py tests/test_gpu_kernels.py tests/test_gpu_support.py \
  tests/test_gpu_descriptors.py > $OUT/gputests.txt 2>&1
tail -3 $OUT/gputests.txt
timeout 200 orbitkv-bench pipeline --device gpu --only throughput --blocks 512 --layers 36 --segment-kib 32,512 \
  --repeat 5 --codecs none,fp8,turboquant-4 --block-order shuffled --storage-codec-budget-mib 64 \
  --out $OUT/pipeline > $OUT/pipeline.log 2>&1
tail -30 $OUT/pipeline/pipeline-gpu.md
