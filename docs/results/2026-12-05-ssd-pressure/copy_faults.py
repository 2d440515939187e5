"""Where the demotion's arena-to-staging copy goes in `pressure_ssd.py ssd`: each copy into a staging buffer
(`record.write_record_body`) timed, with this thread's minor page faults around it, and the copies that met a
fault counted per batch of 8,192 demotions (one save's victims).

Usage: PYTHONPATH=<tree> python copy_faults.py"""

from __future__ import annotations

import collections
import os
import resource
import runpy
import sys
import time

import orbitkv_fs.tiers.ssd.lane as lane

_copy = lane.write_record_body
c: collections.Counter = collections.Counter()


def timed(buf, seg):  # noqa: ANN001, ANN201
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter()
    r = _copy(buf, seg)
    dt = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
    c["n"] += 1
    c["t"] += dt
    if faults:
        c["n_fault"] += 1
        c["t_fault"] += dt
        c[f"batch {(c['n'] - 1) // 8192}"] += 1
    return r


lane.write_record_body = timed
sys.argv = ["pressure_ssd.py", "ssd"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pressure_ssd.py"), run_name="__main__")
print({k: v for k, v in c.items() if k.startswith("batch")})
print(f"copies {c['n']}: {c['n_fault']} met a page fault, {c['t_fault'] / max(c['n_fault'], 1) * 1e6:.0f} us each; "
      f"the others {(c['t'] - c['t_fault']) / (c['n'] - c['n_fault']) * 1e6:.2f} us each")
