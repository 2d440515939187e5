#!/usr/bin/env bash
# Variants of `orbitkv-bench pipeline` in one machine session, rounds rotating their order. Each variant is a
# tree (a checkout laid out as the build maps it: orbitkv_fs/ with gpu/, server/, tools/ inside), named
# NAME=DIR in VARIANTS (default "base=ab-prev new=."). One discarded run first (a fresh machine's first
# minute runs slower). Runs end up in OUT/runs.tgz (the device returns a few files only).
# Usage, from the repository root: ab.sh OUT ROUNDS BENCH_ARGS...
set -u
root=$(pwd) out=$1 rounds=$2
shift 2
read -r -a vs <<< "${VARIANTS:-base=ab-prev new=.}"
names=()
for v in "${vs[@]}"; do
  name=${v%%=*} dir=$root/${v#*=}
  rm -rf "/tmp/ab/$name" && mkdir -p "/tmp/ab/$name" && cp -r "$dir/orbitkv_fs" "/tmp/ab/$name/" || exit 1
  for d in gpu server tools; do cp -r "$dir/$d" "/tmp/ab/$name/orbitkv_fs/$d" || exit 1; done
  names+=("$name")
done
mkdir -p "$out/runs" && out=$(cd "$out" && pwd) && cd /tmp || exit 1
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
for name in "${names[@]}"; do
  PYTHONPATH=/tmp/ab/$name${PYTHONPATH:+:$PYTHONPATH} python3 -c "import orbitkv_fs.manager.save as m, orbitkv_fs.gpu.engine as e
assert m.__file__.startswith('/tmp/ab/$name/') and e.__file__.startswith('/tmp/ab/$name/'), (m.__file__, e.__file__)" || exit 1
done
PYTHONPATH=/tmp/ab/${names[0]}${PYTHONPATH:+:$PYTHONPATH} python3 -m orbitkv_fs.tools.bench pipeline "$@" > /dev/null 2>&1
for r in $(seq 1 "$rounds"); do
  for i in "${!names[@]}"; do
    v=${names[$(( (i + r - 1) % ${#names[@]} ))]}
    s=$(date +%s)
    PYTHONPATH=/tmp/ab/$v${PYTHONPATH:+:$PYTHONPATH} python3 -m orbitkv_fs.tools.bench pipeline "$@" \
      --out "$out/runs/$v-$r" > "$out/runs/$v-$r.txt" 2>&1 || echo "round $r $v failed"
    echo "round $r $v: $(( $(date +%s) - s )) s"
  done
done
tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
