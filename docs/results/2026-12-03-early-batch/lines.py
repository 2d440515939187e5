"""Line-level host time of the pipeline bench's save and restore batch steps (line_profiler).

Usage: python lines.py OUT -- <orbitkv-bench pipeline arguments>
Profiles the functions a GPU save or restore batch runs through, over the whole bench run (line_profiler adds
a fixed cost per line: read the shares, not the totals), and writes OUT/lines.txt."""

from __future__ import annotations

import os
import sys

from line_profiler import LineProfiler

from orbitkv_fs.gpu import engine as E
from orbitkv_fs import index as I
from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.manager import device as D
from orbitkv_fs.manager import restore as R
from orbitkv_fs.manager import save as S
from orbitkv_fs.manager import verify as V
from orbitkv_fs.manager.batching import Batching
from orbitkv_fs.tiers import dram as T
from orbitkv_fs.tools import bench_pipeline as B

FUNCS = [S.SavePipeline.save, S.SavePipeline._save_submit, S.SavePipeline._save_finish, S.SavePipeline._save_columns,
         S.SavePipeline._save_items, S._segment_fields, S._gaps, Batching._run_batches,
         D._GpuCodecs.gather_rows, D._Targets.places, D._Targets.table, D._Targets.__init__,
         D._GpuCodecs.decode_rows_submit, D._GpuCodecs.decode_rows_finish,
         E.GpuCodecEngine.encode_columns_submit, E.GpuCodecEngine._run_encode_columns,
         E.GpuCodecEngine._finish_encode_columns, E.GpuCodecEngine.encode_collect, E._write_headers, E._encode_rows,
         E._enc_offsets, E._prefix_batches, E.Worker.copy_blocks, E.Worker.place, E.Worker.finish,
         E.GpuCodecEngine.decode_columns_submit, E.GpuCodecEngine._run_decode_columns, E._decode_rows, E._mirror,
         E._header_cols, R.RestorePipeline.restore, R.RestorePipeline._decode_gpu_rows,
         R.RestorePipeline._verified_rows, R.RestorePipeline._check_device_batch, R.RestorePipeline._rows_end,
         V._verify_headers, T.DramTier.publish_many, T.DramTier._publish_many, ObjectIndex.add_many,
         ObjectIndex._add_fresh, ObjectIndex._place, I.put_columns]


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--")
    out = argv[0]
    lp = LineProfiler()
    for f in FUNCS:
        lp.add_function(getattr(f, "__func__", f))
    lp.enable_by_count()
    try:
        B.main(argv[cut + 1:] + ["--out", out])
    finally:
        lp.disable_by_count()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lines.txt"), "w") as f:
        lp.print_stats(stream=f, output_unit=1e-6, stripzeros=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
