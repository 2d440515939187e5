"""Steady-state per-step host time of `orbitkv-bench pipeline` from two stage_timers.py runs of one process shape that
differ only in --repeat (the smaller one holds the warm-up: numba and kernel caches loaded, first plans made): the
difference of each step's calls and inclusive wall time, per repeat (one save and one restore) and per segment.
Usage: stage_diff.py SHORT.txt LONG.txt REPEATS_BETWEEN SEGMENTS [TOP]"""
import sys


def load(path: str) -> dict[str, tuple[int, float]]:
    out = {}
    for line in open(path).read().splitlines()[1:]:
        parts = line.split()
        try:
            out[parts[0]] = (int(parts[1]), float(parts[2]))
        except (IndexError, ValueError):
            continue
    return out


short, long_, reps, segs = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
top = int(sys.argv[5]) if len(sys.argv) > 5 else 30
rows = []
for name, (calls, ms) in long_.items():
    c0, m0 = short.get(name, (0, 0.0))
    rows.append((name, (calls - c0) / reps, (ms - m0) / reps * 1e3))
print("| step (inclusive) | calls a repeat | us a repeat | us a segment |")
print("| --- | ---: | ---: | ---: |")
for name, calls, us in sorted(rows, key=lambda r: -r[2])[:top]:
    print(f"| {name} | {calls:.0f} | {us:.0f} | {us / segs:.2f} |")
