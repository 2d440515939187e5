"""cProfile of the Manager's GPU save and restore (the pipeline benchmark's setup: 36 layers, 512 blocks,
shuffled), one profile per operation, and how many restore payloads went up straight from the pinned
arena (``_dec_layout``'s ``hosts``) against those staged through the upload buffer.

    python prof.py fp8:512:64 none:4096:64   # codec:segment KiB:budget MiB
"""
import cProfile
import collections
import io
import pstats
import sys

from orbitkv_fs import manager as M
from orbitkv_fs.gpu import engine as E
from orbitkv_fs.tools import bench_pipeline as bp

PROF: dict = {}
ON = [False]
DIRECT = collections.Counter()
for name in ("save", "restore"):
    f = getattr(M.Manager, name)

    def g(self, *a, _f=f, _n=name, **k):
        if not ON[0]:
            return _f(self, *a, **k)
        p = PROF.setdefault(_n, cProfile.Profile())
        p.enable()
        try:
            return _f(self, *a, **k)
        finally:
            p.disable()
    setattr(M.Manager, name, g)
_layout = E.GpuCodecEngine._dec_layout


def dec_layout(self, plans, hosts):
    DIRECT["direct"] += len(hosts)
    DIRECT["staged"] += sum(1 for p in plans if p.i not in hosts and not p.dev)
    return _layout(self, plans, hosts)


E.GpuCodecEngine._dec_layout = dec_layout

if __name__ == "__main__":
    for spec in sys.argv[1:]:
        codec, kib, mib = spec.split(":")
        kw = dict(layers=36, segment_sizes=(int(kib) << 10,), codec_budget=int(mib) << 20)
        ON[0] = False
        plain = bp.bench_throughput_gpu([codec], 512, 3, "shuffled", **kw)["runs"][0]
        PROF.clear()
        DIRECT.clear()
        ON[0] = True
        r = bp.bench_throughput_gpu([codec], 512, 3, "shuffled", **kw)["runs"][0]
        ON[0] = False
        print(f"== {spec}: plain save {plain['save_gbs']:.1f} restore {plain['restore_gbs']:.1f} GB/s; profiled "
              f"save {r['save_gbs']:.1f} restore {r['restore_gbs']:.1f}; restore payloads direct "
              f"{DIRECT['direct']} staged {DIRECT['staged']}", flush=True)
        for n, p in PROF.items():
            s = io.StringIO()
            st = pstats.Stats(p, stream=s)
            st.sort_stats("tottime").print_stats(28)
            st.print_callers("alloc_pinned_memory")
            print(f"--- {n}\n" + s.getvalue()[-9000:])
