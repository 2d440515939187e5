"""The GPU engine's host work per segment of a save request (encode_columns_submit, then collect), with no CUDA
behind it: a worker that records nothing, nvCOMP and the kernels as no-ops, every ANS payload 0.7 of its source.
One Manager batch of the issue's bench (254 x 512 KiB, 31 x 4 MiB; 256 MiB workspace), best of 30.
Needs numpy, numba, ml_dtypes and cupy importable (no GPU). Usage: PYTHONPATH=TREE python engine_host.py
(TREE laid out as the build maps it: orbitkv_fs/ with gpu/ inside; run it from outside the checkout)."""
import time, types, threading
from collections import Counter
import numpy as np, ml_dtypes
from orbitkv_fs.gpu import engine as E
from orbitkv_fs.segment import Role
BF16 = np.dtype(ml_dtypes.bfloat16)

class W:
    def __init__(self):
        self.lock, self.stats = threading.Lock(), Counter()
        self.stream = self.copies = types.SimpleNamespace(ptr=0)
        self.buffers = [np.zeros(160 << 20, np.uint8) for _ in range(2)]
        self.n = 0; self.inflight = []
    def wait_for_current(self): pass
    def place(self, nbytes):
        while len(self.inflight) > 1: self.finish(self.inflight[0])
        buf = self.buffers[self.n % 2]; self.n += 1
        return 1 << 40, types.SimpleNamespace(get=lambda n, b=buf: b[:n])
    def h2d(self, *a): pass
    def h2d_raw(self, *a): pass
    def d2h(self, *a): pass
    def handoff(self, *a): pass
    def fetch(self, *a): pass
    def launch(self, *a): pass
    def launched(self, base, nbytes, upload, finish, last=None):
        f = E._Flight(0, nbytes, 0, None, finish); self.inflight.append(f); return f
    def finish(self, f):
        if f in self.inflight: self.inflight.remove(f); f.finish()
    def drop(self, fl): pass

E.km.launch_ans_place = lambda *a: 1
regions = [np.zeros(160 << 20, np.uint8) for _ in range(4)]
E._pinned_array = lambda n, it=iter(range(10**9)): regions[next(it) % 4][:max(n, 1)]
_fin = E.GpuCodecEngine._finish_encode_columns
def _fin_with_lengths(self, *args):
    host, off, a = args[6], args[8], args[9]
    if a is not None and len(a):
        at = off["pay_len"] - off["meta"]
        n = self._cur_n
        host[at:at + 8 * len(a)].view("<u8")[:] = (int(n * 0.7) + 7) // 8 * 8
    return _fin(self, *args)
E.GpuCodecEngine._finish_encode_columns = _fin_with_lengths
def engine(budget):
    eng = object.__new__(E.GpuCodecEngine)
    eng.budget_bytes = budget
    eng.seed, eng._classes, eng._rows, eng._class_sets, eng._plans, eng._ans_packed = 7, {}, {}, {}, {}, 0.7
    eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
    eng.save = W()
    eng._nvcomp = types.SimpleNamespace(max_compressed_bytes=lambda n, t: 89288, compress_temp_bytes=lambda c, cb, total, t: 0,
                                        compress=lambda *a: None)
    return eng

def run(codec, seg_kib, nseg, budget=256 << 20, reps=30):
    eng = engine(budget)
    shape = (seg_kib * 1024 // 256 // 2, 128)  # 16 tokens? any shape with the right bytes
    shape = (seg_kib * 512 // 128, 128)
    n = seg_kib * 1024
    cls_ = eng.encode_class(E.EncodeItem(E.DeviceSpan(1 << 41, n, shape), codec, Role.KEY, 3, BF16))
    classes = [cls_]
    eng._cur_n = n
    cls = np.zeros(nseg, np.int64)
    ptrs = (1 << 41) + n * np.arange(nseg)
    best = 1e9
    for r in range(reps):
        t0 = time.perf_counter()
        job = eng.encode_columns_submit(classes, cls, ptrs, out_region=lambda nb, it=iter(range(10**9)): regions[next(it) % 4][:nb])
        eng.encode_collect(job)
        dt = time.perf_counter() - t0
        if r: best = min(best, dt)
    return best / nseg * 1e6, dict(eng.save.stats)

for codec, kib, nseg in [("none", 512, 254), ("ans", 512, 254), ("none", 4096, 31), ("ans", 4096, 31)]:
    us, st = run(codec, kib, nseg)
    print(f"{codec:5s} {kib:5d} KiB x {nseg}: {us:6.2f} us/seg  {st}")
