"""cProfile the Manager's save and restore separately, GPU pipeline bench setup (36 layers, shuffled)."""
import cProfile, pstats, sys, io, os
from orbitkv_fs.tools import bench_pipeline as bp
from orbitkv_fs import manager as M

PROF = {"save": cProfile.Profile(), "restore": cProfile.Profile()}
ON = [True]
for name in ("save", "restore"):
    f = getattr(M.Manager, name)
    def g(self, *a, _f=f, _n=name, **k):
        if not ON[0]:
            return _f(self, *a, **k)
        p = PROF[_n]
        p.enable()
        try:
            return _f(self, *a, **k)
        finally:
            p.disable()
    setattr(M.Manager, name, g)

if __name__ == "__main__":
    codecs = sys.argv[1].split(",")
    sizes = [int(x) << 10 for x in sys.argv[2].split(",")]
    out = sys.argv[3]
    budget = int(sys.argv[4]) << 20 if len(sys.argv) > 4 else 64 << 20
    for codec in codecs:
        for size in sizes:
            for p in PROF.values():
                p.clear() if hasattr(p, "clear") else None
            PROF["save"], PROF["restore"] = cProfile.Profile(), cProfile.Profile()
            ON[0] = False
            res = bp.bench_throughput_gpu([codec], 512, 3, "shuffled", layers=36, segment_sizes=(size,), codec_budget=budget)
            plain = res["runs"][0]
            ON[0] = True
            res = bp.bench_throughput_gpu([codec], 512, 3, "shuffled", layers=36, segment_sizes=(size,), codec_budget=budget)
            r = res["runs"][0]
            print(f"== {codec} {size>>10} KiB: plain save {plain['save_gbs']:.1f} restore {plain['restore_gbs']:.1f} "
                  f"(base {plain['save_baseline_gbs']:.1f}/{plain['restore_baseline_gbs']:.1f}); profiled save {r['save_gbs']:.1f} restore {r['restore_gbs']:.1f}", flush=True)
            for n, p in PROF.items():
                p.dump_stats(os.path.join(out, f"{codec}-{size>>10}-{n}.pstats"))
                s = io.StringIO()
                pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(25)
                print(f"--- {n} tottime\n" + s.getvalue()[-6000:])
