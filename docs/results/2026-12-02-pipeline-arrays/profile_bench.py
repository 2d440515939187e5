"""Profile `orbitkv-bench pipeline` (its main thread: the save and restore requests) under cProfile.
Usage: python profile_bench.py OUT BENCH_ARGS... -> OUT/profile.txt (by own time, by cumulative time, and the
save and restore stages' callees) and OUT/profile.prof (the raw stats, for pstats). Needs Python 3.12 or later
(the GPU machine's), where cProfile sees every thread: the bench runs its requests in a thread of its own."""

from __future__ import annotations

import cProfile
import io
import pstats
import runpy
import sys


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    sys.argv = ["orbitkv-bench", "pipeline", *args]
    prof = cProfile.Profile()
    prof.enable()
    try:
        runpy.run_module("orbitkv_fs.tools.bench", run_name="__main__")
    except SystemExit:
        pass
    prof.disable()
    prof.dump_stats(f"{out}/profile.prof")
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats(80)
    # the requests' own subtrees: what each stage of save and restore calls
    stats.print_callees(r"_save_submit|_save_finish|_decode_gpu_rows|_rows_end|restore\.py.*\(restore\)")
    with open(f"{out}/profile.txt", "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
