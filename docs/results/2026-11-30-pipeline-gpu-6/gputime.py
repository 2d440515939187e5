"""Where the GPU's time goes in the Manager's save and restore: CUDA events around every copy and kernel
launch of the codec engine, per call: busy time per stream and operation, the union of busy time over
both streams, and the idle remainder of the call's span. Events add host time; the wall figures printed
here are not the benchmark's (run ``orbitkv-bench pipeline`` for those).

    python gputime.py none:4096:64 fp8:4096:64 turboquant-4:4096:64   # codec:segment KiB:budget MiB
"""
import collections
import sys
import time

import cupy as cp

from orbitkv_fs import manager as M
from orbitkv_fs.gpu import module as km
from orbitkv_fs.tools import bench_pipeline as bp

OPS: list = []  # (category, stream ptr, start event, end event)
_KIND = {1: "h2d", 2: "d2h", 3: "d2d"}
_memcpy = cp.cuda.runtime.memcpyAsync


def _timed(cat: str, stream_ptr: int, fn):
    s = cp.cuda.ExternalStream(stream_ptr)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(s)
    out = fn()
    b.record(s)
    OPS.append((cat, stream_ptr, a, b))
    return out


def memcpy(dst, src, n, kind, stream):
    return _timed(_KIND.get(kind, "copy"), stream, lambda: _memcpy(dst, src, n, kind, stream))


cp.cuda.runtime.memcpyAsync = memcpy
_launch, _blocks = km.launch, km.launch_copy_blocks
km.launch = lambda k, name, *a, **kw: _timed(name, a[4].ptr, lambda: _launch(k, name, *a, **kw))
km.launch_copy_blocks = lambda k, t, n, s: _timed("okv_copy_blocks", s.ptr, lambda: _blocks(k, t, n, s))


def _union(iv: list) -> float:
    tot, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b > end:
            tot += b - max(a, end)
            end = b
    return tot


def report(name: str, wall: float) -> None:
    cp.cuda.Device().synchronize()
    if not OPS:
        return
    ref = OPS[0][2]
    iv = [(c, s, cp.cuda.get_elapsed_time(ref, a), cp.cuda.get_elapsed_time(ref, b)) for c, s, a, b in OPS]
    span = max(b for *_, b in iv) - min(a for _, _, a, _ in iv)
    busy = collections.defaultdict(float)
    count = collections.Counter()
    for c, _, a, b in iv:
        busy[c] += b - a
        count[c] += 1
    streams = {s for _, s, _, _ in iv}
    per_stream = {s: _union([(a, b) for _, t, a, b in iv if t == s]) for s in streams}
    union = _union([(a, b) for *_, a, b in iv])
    print(f"   {name}: wall {wall * 1e3:.1f} ms, GPU span {span:.1f} ms, busy {union:.1f} ms (idle {span - union:.1f}), "
          f"per stream {' + '.join(f'{v:.1f}' for v in sorted(per_stream.values(), reverse=True))} ms")
    print("      " + "  ".join(f"{c}={busy[c]:.2f}/{count[c]}" for c in sorted(busy, key=busy.get, reverse=True)))
    OPS.clear()


for method in ("save", "restore"):
    f = getattr(M.Manager, method)

    def wrapped(*a, _f=f, _n=method, **k):
        OPS.clear()
        t = time.perf_counter()
        try:
            return _f(*a, **k)
        finally:
            report(_n, time.perf_counter() - t)

    setattr(M.Manager, method, wrapped)

if __name__ == "__main__":
    for spec in sys.argv[1:]:
        codec, size, budget = spec.split(":")
        res = bp.bench_throughput_gpu([codec], 512, 2, "shuffled", layers=36, segment_sizes=(int(size) << 10,),
                                      codec_budget=int(budget) << 20)
        r = res["runs"][0]
        print(f"== {spec}: save {r['save_gbs']:.1f} restore {r['restore_gbs']:.1f} GB/s (with event overhead)")
