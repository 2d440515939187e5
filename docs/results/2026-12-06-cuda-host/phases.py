"""The shares of a sampled bench's restore (or save) that fall in its phases and in the CUDA side of the host's
work, from py-spy's raw stacks (``py-spy record --threads --nolineno --format raw``, Python frames: what a C call
costs is counted in the Python function that made it).

Samples of a kernel build or a numba compile (the first calls of a fresh process; llvmlite) are left out. The CUDA side
is a sample whose outermost frame of the GPU engine's ``Worker`` (its launches, copies, events, waits and
finishes: ``Worker.finish`` includes the host part of a finished batch, so this over-counts), of the kernel
module (``gpu/module.py``: launches) or of cupy (``cupy.empty``: a batch's temporary) comes first in the stack.
Usage: python phases.py RAW[.gz] [restore|save]"""

from __future__ import annotations

import sys
from collections import Counter

from fold import read_stacks  # this folder's, beside this script

ROOTS = {"restore": "RestorePipeline.restore", "save": "SavePipeline.save"}
PHASES = {
    "restore": ["RestorePipeline._acquire", "Leases._lease_dram", "RestorePipeline._check_device_batch",
                "_header_rows_at", "segment_keys", "_Rows.of", "RestorePipeline._start_early",
                "RestorePipeline._decode_gpu_rows", "RestorePipeline._verified_rows", "_verify_headers",
                "RestorePipeline._rows_submit", "_Targets.places", "GpuCodecEngine.decode_columns_submit",
                "RestorePipeline._rows_end", "GpuCodecEngine.decode_collect", "_Targets.table",
                "GpuCodecEngine.scatter_blocks", "DramTier.unlease_rows"],
    "save": ["SavePipeline._save_submit", "SavePipeline._save_finish", "GpuCodecEngine.encode_columns_submit",
             "GpuCodecEngine.encode_collect", "_GpuCodecs.gather_rows", "DramTier.publish_many",
             "ObjectIndex.add_many", "_Targets.places", "_Targets.table"],
}
_WARMUP = ("parse_bitcode", "kernels", "_compile_for_args", "compile_and_invoke")


def _name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def _cuda(frame: str) -> bool:
    return "Worker." in _name(frame) or "(gpu/module.py)" in frame or "(cupy/" in frame


def shares(path: str, which: str) -> tuple[int, Counter, Counter]:
    """Samples under the pipeline's entry (warm-up left out), by phase (inclusive) and by CUDA-side frame."""
    root = ROOTS[which]
    total, phases, cuda = 0, Counter(), Counter()
    for frames, count in read_stacks(path):
        names = [_name(x) for x in frames]
        if root not in names or any(x in _WARMUP for x in names) or any("(llvmlite/" in x for x in frames):
            continue
        total += count
        for x in set(names) & set(PHASES[which]):
            phases[x] += count
        first = next((x for x in frames if _cuda(x)), None)
        cuda[_name(first) if first else "(host: Python and numpy)"] += count
    return total, phases, cuda


def main() -> None:
    path, which = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "restore"
    total, phases, cuda = shares(path, which)
    print(f"{total} samples under {ROOTS[which]} (warm-up left out)\n\n| phase (inclusive) | samples | share |\n"
          "| --- | ---: | ---: |")
    for p in PHASES[which]:
        print(f"| `{p}` | {phases[p]} | {phases[p] / max(total, 1):.1%} |")
    print("\n| CUDA side: outermost frame | samples | share |\n| --- | ---: | ---: |")
    for k, v in cuda.most_common():
        print(f"| `{k}` | {v} | {v / max(total, 1):.1%} |")
    side = total - cuda["(host: Python and numpy)"]
    print(f"\nCUDA side in all: {side} of {total} samples, {side / max(total, 1):.1%}")


if __name__ == "__main__":
    main()
