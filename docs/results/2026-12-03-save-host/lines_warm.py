"""Line-level host time of a warm save (and restore): the pipeline bench run once unprofiled (numba compiles,
CUDA modules, the first engine), then again under line_profiler.

Usage: python lines_warm.py OUT -- <orbitkv-bench pipeline arguments>
Profiles the functions of ../2026-12-03-early-batch/lines.py and the save's steps that file left out, during the
second run only, and writes OUT/lines.txt (line_profiler adds a fixed cost per line hit: read shares)."""

from __future__ import annotations

import importlib.util
import os
import sys

from line_profiler import LineProfiler

from orbitkv_fs.gpu import engine as E
from orbitkv_fs.gpu import placement as P
from orbitkv_fs.manager import batching as BT
from orbitkv_fs.manager import device as D
from orbitkv_fs.manager import save as S
from orbitkv_fs.tools import bench_pipeline as B

_spec = importlib.util.spec_from_file_location(
    "lines", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-early-batch", "lines.py"))
_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lines)

FUNCS = _lines.FUNCS + [S.SaveRows.join, S.SavePipeline._ssd_direct_sink, S._classes_of, BT._pipelined,
                        E.GpuCodecEngine._class_set, E.GpuCodecEngine._enc_cuts, E.GpuCodecEngine._launch_encode,
                        E.Worker.launched, E._enc_groups, E.EncodeJob.of, D._table_of, D._block_rows,
                        P.place_beside]


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--")
    out = argv[0]
    bench = argv[cut + 1:]
    B.main(bench + ["--out", os.path.join(out, "warm")])
    lp = LineProfiler()
    for f in FUNCS:
        lp.add_function(getattr(f, "__func__", f))
    lp.enable_by_count()
    try:
        B.main(bench + ["--out", os.path.join(out, "run")])
    finally:
        lp.disable_by_count()
    with open(os.path.join(out, "lines.txt"), "w") as f:
        lp.print_stats(stream=f, output_unit=1e-6, stripzeros=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
