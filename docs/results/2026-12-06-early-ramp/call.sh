#!/usr/bin/env bash
# One device call for the smaller first restore batch (ramp.patch: EARLY_FIRST_SHARE = 2, a first early part of
# half a batch's chunks, then a batch's), from a checkout of main without it: base is this tree as it is; the
# patch is then applied here (new), and three is new with EARLY_BATCHES = 3. The GPU tests of the early batches
# run on new; then each variant's timeline of the 512 KiB restores (which engine is busy when); then as many
# alternating rounds of base and new in the bench (`none` and `turboquant-4`, 512 KiB, three repeats) as fit in
# what is left of LIMIT seconds from the script's start. Runs end up in OUT/ab/runs.tgz.
# Usage, from the repository root after the device prelude: [TESTS=0] call.sh OUT LIMIT (TESTS=0: no GPU tests;
# no rounds when a minute or less of LIMIT is left for them)
set -u
here=docs/results/2026-12-06-early-ramp
out=$1 limit=$2 root=$(pwd)
mkdir -p "$out"
rm -rf ab-prev && mkdir ab-prev && cp -r orbitkv_fs gpu server tools ab-prev/ || exit 1
patch -p1 < "$here/ramp.patch" || exit 1
rm -rf ab-three && mkdir ab-three && cp -r orbitkv_fs gpu server tools ab-three/ || exit 1
sed -i 's/^EARLY_BATCHES = 2$/EARLY_BATCHES = 3/' ab-three/orbitkv_fs/manager/batching.py
grep -q "^EARLY_BATCHES = 3$" ab-three/orbitkv_fs/manager/batching.py || exit 1
VARIANTS="base=ab-prev new=. three=ab-three"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 180 python3 -m pytest -q -m gpu tests/test_manager_gpu.py \
    -k "early or shuffled or restore_as_arrays or corrupt" > "$out/gpu-tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.txt"
fi
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -m1 "Model name"
ARGS="--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --storage-codec-budget-mib 256
  --repeat 3 --segment-kib 512 --codecs none,turboquant-4"
for v in $VARIANTS; do  # the trees as ab.sh lays them out
  name=${v%%=*} dir=$root/${v#*=}
  rm -rf "/tmp/ab/$name" && mkdir -p "/tmp/ab/$name" && cp -r "$dir/orbitkv_fs" "/tmp/ab/$name/" || exit 1
  for d in gpu server tools; do cp -r "$dir/$d" "/tmp/ab/$name/orbitkv_fs/$d" || exit 1; done
done
python3 -m pip uninstall -y -q orbitkv-fs >/dev/null 2>&1
for name in new base three; do
  PYTHONPATH=/tmp/ab/$name${PYTHONPATH:+:$PYTHONPATH} timeout 50 python3 \
    docs/results/2026-12-06-fill-drain/timeline.py "$out/timeline-$name" --keep 2 -- $ARGS \
    > "$out/timeline-$name.log" 2>&1
  echo "timeline $name rc=$?"
  grep -A3 "^== restore" "$out/timeline-$name.log"
  rm -rf "$out/timeline-$name"
done
left=$((limit - SECONDS))
[ "$left" -gt 60 ] && VARIANTS="base=ab-prev new=." timeout "$left" \
  bash docs/results/2026-12-02-restore-prefix/ab.sh "$out/ab" 40 $ARGS
[ -d "$out/ab/runs" ] && tar -C "$out/ab" -czf "$out/ab/runs.tgz" runs && rm -rf "$out/ab/runs"
exit 0
