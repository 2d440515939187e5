"""Where the host's time goes in the Manager's GPU save and restore, per call, without a profiler's
overhead: perf_counter wrappers around a few functions (cumulative, nested calls counted in each), the time
the host waits on the GPU (``Worker.finish``'s event synchronisation), the lead-in (call start to the
engine's first submit) and the tail (the last engine collect to the call's end), and the calling thread's CPU time.

    python hostphases.py none:4096:64 fp8:4096:64 turboquant-4:4096:64   # codec:segment KiB:budget MiB
    python hostphases.py --freeze none:4096:64   # gc.freeze() before each figure

Also the garbage collector's pauses per call, by generation (``gc.callbacks``).
"""
import collections
import gc
import sys
import time

from orbitkv_fs import manager as M
from orbitkv_fs.gpu import engine as E
from orbitkv_fs.tools import bench_pipeline as bp

T: collections.Counter = collections.Counter()
N: collections.Counter = collections.Counter()
MARK: dict = {}


def wrap(cls, name: str, label: str, first: str = "", last: str = "") -> None:
    f = getattr(cls, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        if first and first not in MARK:
            MARK[first] = t0
        try:
            return f(*a, **k)
        finally:
            t1 = time.perf_counter()
            T[label] += t1 - t0
            N[label] += 1
            if last:
                MARK[last] = t1
    setattr(cls, name, g)


for name in ("_acquire", "_save_submit", "_save_finish", "_decode_start", "_decode_end", "_save_batches",
             "_decode_gpu", "_check_chunks"):
    wrap(M.Manager, name, name)
wrap(M, "_verify_header", "_verify_header")
wrap(E.GpuCodecEngine, "encode_submit", "engine.encode_submit", first="first_submit")
wrap(E.GpuCodecEngine, "decode_submit", "engine.decode_submit", first="first_submit")
wrap(E.GpuCodecEngine, "encode_collect", "engine.encode_collect", last="last_collect")
wrap(E.GpuCodecEngine, "decode_collect", "engine.decode_collect", last="last_collect")
for name in ("_run_encode", "_run_decode", "_finish_encode", "_finish_decode", "_classify", "_dec_plan"):
    wrap(E.GpuCodecEngine, name, "engine." + name)


def finish(self, f):  # Worker.finish, split into the GPU wait and the host part
    if f not in self.inflight:
        return
    t0 = time.perf_counter()
    f.event.synchronize()
    t1 = time.perf_counter()
    self.stats["syncs"] += 1
    self.inflight.remove(f)
    f.finish()
    T[f"{self.name}: wait for GPU"] += t1 - t0
    T[f"{self.name}: host part"] += time.perf_counter() - t1
    N[f"{self.name}: wait for GPU"] += 1


E.Worker.finish = finish
_gc_t0 = [0.0]


def gc_pause(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        T[f"gc gen{info['generation']}"] += time.perf_counter() - _gc_t0[0]
        N[f"gc gen{info['generation']}"] += 1


gc.callbacks.append(gc_pause)
CALLS: list = []
for op in ("save", "restore"):
    fn = getattr(M.Manager, op)

    def g(self, *a, _f=fn, _op=op, **k):
        T.clear(), N.clear(), MARK.clear()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        r = _f(self, *a, **k)
        t1 = time.perf_counter()
        T["host CPU time (thread)"] = time.thread_time() - c0
        CALLS.append((_op, t1 - t0, MARK.get("first_submit", t1) - t0, t1 - MARK.get("last_collect", t1),
                      dict(T), dict(N)))
        return r
    setattr(M.Manager, op, g)

if __name__ == "__main__":
    freeze = "--freeze" in sys.argv
    for spec in [a for a in sys.argv[1:] if a != "--freeze"]:
        codec, kib, mib = spec.split(":")
        CALLS.clear()
        if freeze:
            gc.collect()
            gc.freeze()
        res = bp.bench_throughput_gpu([codec], 512, 6, "shuffled", layers=36, segment_sizes=(int(kib) << 10,),
                                      codec_budget=int(mib) << 20)
        r = res["runs"][0]
        print(f"== {spec}{' (gc.freeze)' if freeze else ''}: save {r['save_gbs']:.1f} restore {r['restore_gbs']:.1f} GB/s "
              f"(pinned copy {r['save_baseline_gbs']:.1f} / {r['restore_baseline_gbs']:.1f}), {r['segments']} segments")
        for op in ("save", "restore"):
            calls = [c for c in CALLS if c[0] == op][1:]  # the first call of each warms up
            best = min(calls, key=lambda c: c[1])
            _, wall, lead, tail, t, n = best
            gcs = [sum(v for k, v in c[4].items() if k.startswith("gc")) * 1e3 for c in calls]
            cpus = [c[4]["host CPU time (thread)"] * 1e3 for c in calls]
            print(f"  {op}: wall {wall * 1e3:.2f} ms, lead-in {lead * 1e3:.2f}, tail {tail * 1e3:.2f}; "
                  f"walls of every call {', '.join(f'{c[1] * 1e3:.1f}' for c in calls)} ms, their GC pauses "
                  f"{', '.join(f'{g:.1f}' for g in gcs)} ms, their host CPU time {', '.join(f'{c:.1f}' for c in cpus)} ms")
            for k in sorted(t, key=lambda k: -t[k]):
                print(f"     {k:<32} {t[k] * 1e3:8.2f} ms  x{n.get(k, '')}")
