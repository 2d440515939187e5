"""Where a GPU save's host work goes, without a profiler's per-line cost: save_host.py with the save's batch steps
wrapped in wall-clock accumulators (inclusive: a step's time includes the steps it calls), the first two saves
left out (numba loads, the first classes). Prints microseconds and calls per save.

Usage: python stages.py [save_host.py arguments]"""

from __future__ import annotations

import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import save_host  # noqa: E402
from orbitkv_fs import index as I  # noqa: E402
from orbitkv_fs.gpu import engine as E  # noqa: E402
from orbitkv_fs.manager import Manager  # noqa: E402
from orbitkv_fs.manager import device as D  # noqa: E402
from orbitkv_fs.manager import save as S  # noqa: E402
from orbitkv_fs.tiers import dram as T  # noqa: E402

STEPS = [(S.SavePipeline, ["_save_submit", "_save_finish", "_save_columns"]), (S, ["_segment_fields", "_gaps"]),
         (S.SaveRows, ["join"]), (D._GpuCodecs, ["gather_rows"]), (D._Targets, ["__init__", "places", "table"]),
         (E.GpuCodecEngine, ["encode_columns_submit", "_run_encode_columns", "_finish_encode_columns",
                             "encode_collect", "_launch_encode", "_enc_cuts"]),
         (E, ["_encode_rows", "_write_headers", "_enc_offsets", "_enc_groups"]),
         (T.DramTier, ["publish_many", "reserve", "cancel"]), (I.ObjectIndex, ["add_many"])]

spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def _timed(owner: object, name: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1

    setattr(owner, name, timed)


def main() -> None:
    for owner, names in STEPS:
        for name in names:
            _timed(owner, name)
    saves = [0]
    save = Manager.save

    def counted(self, *a, **k):
        saves[0] += 1
        if saves[0] == 3:  # the steady state: from the third save on
            spent.clear()
            calls.clear()
        return save(self, *a, **k)

    Manager.save = counted
    sys.argv = ["save_host.py"] + sys.argv[1:]
    save_host.main()
    n = saves[0] - 2
    for name, s in spent.most_common():
        print(f"{name:28s} {s / n * 1e6:8.0f} us/save  {calls[name] / n:5.1f} calls/save")


if __name__ == "__main__":
    main()
