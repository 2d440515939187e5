#!/usr/bin/env bash
# One H200 call on the final tree: the command once (every codec, 512 KiB and 4 MiB, 256 MiB workspace),
# then `none` and `ans` with a 1 GiB workspace (docs/codecs.md's recommendation for `ans`), twice each, alternating.
# Usage, from the repository root after the device prelude: device_final.sh OUT
set -u
out=$1
mkdir -p "$out/runs"
cd /tmp || exit 1
args=(--device gpu --only throughput --blocks 512 --layers 36 --block-order shuffled --repeat 3 --segment-kib 512,4096)
python3 -m orbitkv_fs.tools.bench pipeline "${args[@]}" --storage-codec-budget-mib 256 --codecs none,fp8,turboquant-4,ans \
  --out "$out/runs/issue-1" > "$out/runs/issue-1.txt" 2>&1
grep "KiB  save" "$out/runs/issue-1.txt"
for r in 1 2; do
  for b in 1024 256; do
    python3 -m orbitkv_fs.tools.bench pipeline "${args[@]}" --storage-codec-budget-mib $b --codecs none,ans \
      --out "$out/runs/b$b-$r" > "$out/runs/b$b-$r.txt" 2>&1
    echo "== budget $b MiB, run $r"; grep "KiB  save" "$out/runs/b$b-$r.txt"
  done
done
tar -C "$out" -czf "$out/runs.tgz" runs && rm -rf "$out/runs"
