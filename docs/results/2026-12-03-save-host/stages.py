"""Where a GPU save's host work goes, without a profiler's per-line cost: save_host.py with the batch steps wrapped
in the wall-clock timers of ../2026-12-02-pipeline-host-cuts/stage_timers.py (inclusive: a step's time includes
the steps it calls), the first two saves left out (numba loads, the first classes). Prints microseconds and calls
per save, the steps a save ran.

Usage: python stages.py [save_host.py arguments]"""

from __future__ import annotations

import importlib.util
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "stage_timers", os.path.join(here, "..", "2026-12-02-pipeline-host-cuts", "stage_timers.py"))
stage_timers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage_timers)
stage_timers.install()  # before save_host imports the steps by name

sys.path.insert(0, here)
import save_host  # noqa: E402
from orbitkv_fs.manager import Manager  # noqa: E402


def main() -> None:
    saves = [0]
    save = Manager.save

    def counted(self, *a, **k):
        saves[0] += 1
        if saves[0] == 3:  # the steady state: from the third save on (the timers hold their records)
            for rec in stage_timers.stats.values():
                rec[0], rec[1] = 0, 0.0
        return save(self, *a, **k)

    Manager.save = counted
    sys.argv = ["save_host.py"] + sys.argv[1:]
    save_host.main()
    n = saves[0] - 2
    for name, (calls, s) in sorted(stage_timers.stats.items(), key=lambda kv: -kv[1][1]):
        if calls:
            print(f"{name:40s} {s / n * 1e6:8.0f} us/save  {calls / n:5.1f} calls/save")


if __name__ == "__main__":
    main()
