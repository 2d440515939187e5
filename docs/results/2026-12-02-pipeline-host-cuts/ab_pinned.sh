#!/usr/bin/env bash
# ab.sh (docs/results/2026-12-02-pipeline-batch-ab) with every bench process pinned to the CPUs of the GPU's
# NUMA node (taskset), so that both trees' host code runs on the same cores: on the shared H200 host a process
# otherwise runs its host code 1.5-1.8x slower at times (see README.md, section 2). Each run's JSON carries
# the bench's host probe (`host_probe_us`) to check that the runs compared ran at the same host speed.
# Usage, from the repository root: ab_pinned.sh BASE_TREE OUT ROUNDS BENCH_ARGS...   (PIN=0: no pinning)
set -u
here=$(cd "$(dirname "$0")" && pwd)
cpus=""
if [ "${PIN:-1}" != 0 ] && command -v nvidia-smi >/dev/null && command -v taskset >/dev/null; then
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
  dev=/sys/bus/pci/devices/${bus#0000}  # nvidia-smi's domain has 8 digits, sysfs's 4
  [ -e "$dev" ] || dev=/sys/bus/pci/devices/${bus:4}
  node=$(cat "$dev/numa_node" 2>/dev/null || echo -1)
  [ "$node" -ge 0 ] 2>/dev/null && cpus=$(cat /sys/devices/system/node/node$node/cpulist 2>/dev/null)
  allowed=$(taskset -pc $$ | sed 's/.*: //')
  echo "GPU $bus, NUMA node $node, its CPUs ${cpus:-unknown}; this process may use $allowed"
fi
if [ -n "$cpus" ] && taskset -c "$cpus" true 2>/dev/null; then
  echo "pinning every run to CPUs $cpus"
  exec taskset -c "$cpus" bash "$here/../2026-12-02-pipeline-batch-ab/ab.sh" "$@"
fi
echo "no pinning (no GPU, no taskset, or the node's CPUs are not ours)"
exec bash "$here/../2026-12-02-pipeline-batch-ab/ab.sh" "$@"
