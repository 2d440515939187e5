"""Host work per segment of ab.sh runs, the fast calls (probe < 1,150 us) and the slow ones apart, per variant:
calls and median host us per segment (../2026-12-03-host-speed/by_call.py reads the calls).
Usage: split.py RUNS_DIR..."""

import importlib.util
import os
import statistics as st
import sys

_spec = importlib.util.spec_from_file_location(
    "by_call", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-host-speed", "by_call.py"))
by_call = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(by_call)

calls = by_call._calls(sys.argv[1:])
print("| codec | KiB | op | base fast n / host us | new fast n / host us | base slow | new slow |")
for codec in ("none", "fp8", "turboquant-4", "ans"):
    for kib in (512, 4096):
        for op in ("save", "restore"):
            row = []
            for lo, hi in ((0, 1150), (1150, 1e9)):
                for v in ("base", "new"):
                    xs = [h for (o, _, p, h) in calls.get((v, codec, kib), []) if o == op and lo <= p < hi]
                    row.append(f"{len(xs)} / {st.median(xs):.2f}" if xs else "0 / -")
            print(f"| {codec} | {kib} | {op} | " + " | ".join(row) + " |")
