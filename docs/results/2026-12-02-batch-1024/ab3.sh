#!/usr/bin/env bash
# Variants of `orbitkv-bench pipeline` in one machine session, rounds rotating the order: "base" (a checkout
# of the previous main, batch_segments 256, MAX_BATCH 256), "new" (this tree at its defaults) and "newN" (this
# tree with --batch-segments N); VARIANTS picks them (default "base new new512"). Every process pinned to the GPU's NUMA node's CPUs where
# taskset allows (the shared host otherwise runs some processes' host code 1.5-1.8x slower; each run's JSON
# carries the bench's host probe). Runs end up in OUT/runs.tgz (the device returns a few files only).
# Usage, from the repository root: ab3.sh BASE_TREE OUT ROUNDS BENCH_ARGS...
set -u
root=$(pwd)
base=$root/$1 out=$2 rounds=$3
shift 3
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/orbitkv_fs" "$2/" || return 1
  for d in gpu server tools; do cp -r "$1/$d" "$2/orbitkv_fs/$d" || return 1; done
}
lay_out "$base" /tmp/ab/base && lay_out "$root" /tmp/ab/new || exit 1
mkdir -p "$out/runs" && out=$(cd "$out" && pwd) && cd /tmp || exit 1
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
for v in base new; do
  PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} python3 -c "import orbitkv_fs.manager.save as m, orbitkv_fs.gpu.engine as e
assert m.__file__.startswith('/tmp/ab/$v/') and e.__file__.startswith('/tmp/ab/$v/'), (m.__file__, e.__file__)" || exit 1
done
pin=()
if command -v nvidia-smi >/dev/null && command -v taskset >/dev/null; then
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
  dev=/sys/bus/pci/devices/${bus#0000}; [ -e "$dev" ] || dev=/sys/bus/pci/devices/${bus:4}
  node=$(cat "$dev/numa_node" 2>/dev/null || echo -1)
  cpus=""; [ "$node" -ge 0 ] 2>/dev/null && cpus=$(cat /sys/devices/system/node/node$node/cpulist 2>/dev/null)
  echo "GPU $bus, NUMA node $node, CPUs ${cpus:-unknown}; allowed $(taskset -pc $$ | sed 's/.*: //')"
  [ -n "$cpus" ] && taskset -c "$cpus" true 2>/dev/null && pin=(taskset -c "$cpus") && echo "pinned to $cpus"
fi
# One discarded run first: a fresh machine's first minute runs slower.
PYTHONPATH=/tmp/ab/new "${pin[@]}" python3 -m orbitkv_fs.tools.bench pipeline "$@" > /dev/null 2>&1
read -r -a vs <<< "${VARIANTS:-base new new512}"
for r in $(seq 1 "$rounds"); do
  for i in "${!vs[@]}"; do
    v=${vs[$(( (i + r - 1) % ${#vs[@]} ))]}
    tree=$v extra=()
    case $v in new[0-9]*) tree=new extra=(--batch-segments "${v#new}") ;; esac
    s=$(date +%s)
    PYTHONPATH=/tmp/ab/$tree${PYTHONPATH:+:$PYTHONPATH} "${pin[@]}" python3 -m orbitkv_fs.tools.bench pipeline "$@" \
      "${extra[@]}" --out "$out/runs/$v-$r" > "$out/runs/$v-$r.txt" 2>&1 || echo "round $r $v failed"
    echo "round $r $v: $(( $(date +%s) - s )) s"
  done
done
tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
