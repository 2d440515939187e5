"""Line-level host time of a warm restore: the pipeline bench run once unprofiled (numba compiles, CUDA modules,
the first engine), then again with line_profiler on the restore's batch steps, the engine's decode and the
restore worker's calls (its waits on the GPU among them: ``Worker.place`` / ``finish``).

Usage: python lines_restore.py OUT -- <orbitkv-bench pipeline arguments>   (writes OUT/lines.txt)"""

from __future__ import annotations

import os
import sys

from line_profiler import LineProfiler

from orbitkv_fs.gpu import ans_format
from orbitkv_fs.gpu import engine as E
from orbitkv_fs.manager import device as D
from orbitkv_fs.manager import restore as R
from orbitkv_fs.manager import verify as V
from orbitkv_fs.tools import bench_pipeline as B

FUNCS = [R.RestorePipeline.restore, R.RestorePipeline._decode_gpu_rows, R.RestorePipeline._rows_submit,
         R.RestorePipeline._rows_end, R.RestorePipeline._collect_batch, R.RestorePipeline._verified_rows,
         R.RestorePipeline._start_early, R.RestorePipeline._decode_pipelined, D._GpuCodecs.decode_rows_submit,
         D._GpuCodecs.decode_rows_finish, E.GpuCodecEngine.decode_columns_submit, E.GpuCodecEngine._run_decode_columns,
         E.GpuCodecEngine._launch_decode, E.GpuCodecEngine.decode_collect, E._temp_batches, E.Worker.place,
         E.Worker.finish, E.Worker.launched, ans_format.parse_tables, V._verify_headers]
FUNCS += [f for f in (getattr(E.GpuCodecEngine, "_send_decode", None), getattr(E.GpuCodecEngine, "_run_planned_decode", None))
          if f is not None]


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--")
    out, bench = argv[0], argv[cut + 1:]
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
