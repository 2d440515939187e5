"""Where a save's or restore's host time goes, from ``orbitkv-bench pipeline --profile``'s .prof files (the steady
state only): functions by own time, in microseconds per codec batch and per segment, with their calls per batch
(a batch: one ``_save_finish`` / ``_collect_batch`` call). cProfile adds about a microsecond per call, so the
figures overstate many small calls; the counts are exact. Usage: profile_calls.py PROF SEGMENTS [TOP]"""
import pstats
import sys


def main() -> None:
    path, segments = sys.argv[1], int(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    stats = pstats.Stats(path).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
    marker = "_save_finish" if "save" in path else "_collect_batch"
    batches = max(sum(v[1] for k, v in stats.items() if k[2] == marker), 1)
    total = sum(v[2] for v in stats.values())
    calls = sum(v[1] for v in stats.values())
    print(f"{path}: {batches} batches, {segments} segments; {total / batches * 1e6:.0f} us per batch, "
          f"{total / segments * 1e6:.2f} us per segment, {calls / batches:.0f} calls per batch")
    print("  us/batch  us/seg  calls/batch  function")
    for k, v in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{k[0].split('/')[-1]}:{k[1]}" if k[0] != "~" else ""
        print(f"{v[2] / batches * 1e6:10.1f} {v[2] / segments * 1e6:7.3f} {v[1] / batches:12.1f}  {k[2]}  {where}")


main()
