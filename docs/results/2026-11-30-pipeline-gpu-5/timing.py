"""Wall time of the Manager's save/restore vs time the host spends waiting on CUDA events (no cProfile)."""
import sys, time, collections
from orbitkv_fs.tools import bench_pipeline as bp
from orbitkv_fs import manager as M
from orbitkv_fs.gpu import engine as E

T = collections.defaultdict(float)
N = collections.Counter()

def finish(self, f):
    if f not in self.inflight:
        return
    t = time.perf_counter(); f.event.synchronize(); T[self.name + "_wait"] += time.perf_counter() - t; N[self.name + "_wait"] += 1
    self.stats["syncs"] += 1
    self.inflight.remove(f)
    t = time.perf_counter(); f.finish(); T[self.name + "_finish_host"] += time.perf_counter() - t
E.Worker.finish = finish
_sync = E.Worker.sync
def sync(self):
    t = time.perf_counter(); _sync(self); T[self.name + "_streamsync"] += time.perf_counter() - t; N[self.name + "_streamsync"] += 1
E.Worker.sync = sync
for cls, name in [(E.Worker, "copy_blocks"), (E.Worker, "place"), (M.Manager, "_save_finish"), (M.Manager, "_save_submit"),
                  (M, "_gather_batch"), (E.GpuCodecEngine, "encode_submit"), (E.GpuCodecEngine, "_run_encode"), (E.GpuCodecEngine, "block_buffer"),
                  (E.Worker, "wait_for_current"), (E.GpuCodecEngine, "decode_submit"), (E.GpuCodecEngine, "_run_decode"), (M.Manager, "_acquire"),
                  (M.Manager, "_lease_dram"), (M._GpuCodecs, "decode_submit"), (M._GpuCodecs, "decode_finish"), (E.GpuCodecEngine, "_dec_plan"),
                  (E.GpuCodecEngine, "_classify"), (M, "_block_table"), (E.GpuCodecEngine, "scatter_blocks"), (E.GpuCodecEngine, "_finish_encode")]:
    f = getattr(cls, name)
    def g(*a, _f=f, _n=name, **k):
        t = time.perf_counter()
        try:
            return _f(*a, **k)
        finally:
            T[_n] += time.perf_counter() - t; N[_n] += 1
    setattr(cls, name, g)

for name in ("save", "restore"):
    f = getattr(M.Manager, name)
    def g(*a, _f=f, _n=name, **k):
        T.clear(); N.clear()
        t = time.perf_counter()
        try:
            return _f(*a, **k)
        finally:
            dt = time.perf_counter() - t
            print(f"   {_n} {dt*1e3:.1f} ms: " + "  ".join(f"{k}={v*1e3:.1f}/{N[k]}" for k, v in sorted(T.items())))
    setattr(M.Manager, name, g)

if __name__ == "__main__":
    for spec in sys.argv[1:]:
        codec, size, budget = spec.split(":")
        T.clear(); N.clear()
        res = bp.bench_throughput_gpu([codec], 512, 3, "shuffled", layers=36, segment_sizes=(int(size) << 10,), codec_budget=int(budget) << 20)
        r = res["runs"][0]
        print(f"== {spec}: save {r['save_gbs']:.1f} restore {r['restore_gbs']:.1f} GB/s (ms per call, count)")
