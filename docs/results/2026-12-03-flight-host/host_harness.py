"""The GPU engine's host work per flight, without a GPU: ``encode_columns_submit`` / ``decode_columns_submit``
of one Manager batch (the issue's geometry: 36 layers, K and V, 512 KiB segments, a 256 MiB workspace: two
flights of about 256 segments) with the worker's CUDA calls and the kernel launches stubbed out, so that only
the host's Python and numpy run. The flights' host parts (headers, CRC verdicts) run on zeroed metadata (every
status 0). Needs cupy importable (no device is touched). Prints microseconds per batch and per segment, best
of the rounds. Usage, from the repository root: host_harness.py [CODEC] [ROUNDS] [--lines]"""

from __future__ import annotations

import sys
import threading
import time

import ml_dtypes
import numpy as np

import orbitkv_fs.gpu.engine as E
from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, Role

BF16 = np.dtype(ml_dtypes.bfloat16)
UNIT = 512  # the arena's allocation unit (orbitkv_fs.tiers.dram.UNIT)
SEG = 512 << 10
LAYERS = 36
BUDGET = 256 << 20


class _Flight:
    def __init__(self, finish):
        self.finish = finish


class FakeWorker:
    """The Worker's interface with no CUDA: pinned buffers are numpy arrays, copies and events do nothing,
    a flight's host part runs when the next-but-one flight is placed (as the real one waits for it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stream = self.copies = None
        self.uploads = (E._Pinned.__new__(E._Pinned), E._Pinned.__new__(E._Pinned))
        for u in self.uploads:
            u.arr, u._mem = np.zeros(64 << 20, np.uint8), None
        self.inflight: list = []
        self.stats: dict = {}
        self.flip = 0

    def wait_for_current(self) -> None:
        pass

    def handoff(self, *a) -> None:
        pass

    def place(self, nbytes: int):
        while len(self.inflight) > 1:
            self.finish(self.inflight[0])
        self.flip ^= 1
        return (1 << 40) + self.flip * (128 << 20), self.uploads[self.flip]

    def h2d(self, *a) -> None:
        pass

    def h2d_raw(self, *a) -> None:
        pass

    def launched(self, base, total, upload, finish, last=None):
        f = _Flight(finish)
        self.inflight.append(f)
        return f

    def finish(self, f) -> None:
        if f in self.inflight:
            self.inflight.remove(f)
            f.finish()

    def drop(self, flights) -> None:
        self.inflight.clear()


def engine() -> E.GpuCodecEngine:
    eng = object.__new__(E.GpuCodecEngine)
    eng.budget_bytes, eng.seed = BUDGET, 7
    eng._classes, eng._rows, eng._class_sets = {}, {}, {}
    eng._ans_packed = 1.0
    eng._kernels = None
    eng.save, eng.restore = FakeWorker(), FakeWorker()
    eng._nvcomp = None
    return eng


def stub_launches(eng: E.GpuCodecEngine, arena: np.ndarray) -> None:
    """No kernels: an encode flight's output region is a slice of ``arena`` (zeros: statuses 0); a decode
    flight's metadata a zeroed array."""
    def launch_encode(base, off, rows, groups, k, out_region, rounds=None, chunk=0, temp=0, align=E.SLOT_ALIGN):
        n = off["region_end"] - off["meta"]
        return out_region(n), False

    def launch_decode(base, off, firsts, k, calls, chunks):
        return np.zeros(off["down_end"] - off["meta"], np.uint8)

    eng._launch_encode = launch_encode
    eng._launch_decode = launch_decode


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    codec = args[0] if args else "none"
    rounds = int(args[1]) if len(args) > 1 else 20
    eng = engine()
    arena = np.zeros(2 * (BUDGET + (8 << 20)), np.uint8)
    stub_launches(eng, arena)
    # A Manager batch: 7 chunks of 72 segments (36 layers, K and V), their classes as the Manager asks for them.
    classes = [eng.encode_class(E.EncodeItem(E.DeviceSpan(0, SEG, (16, 16, 8, 128)), codec, role, layer, BF16))
               for layer in range(LAYERS) for role in (Role.KEY, Role.VALUE)]
    k = 7 * len(classes) - 4
    cls = np.tile(np.arange(len(classes)), 8)[:k]
    ptrs = (1 << 44) + np.arange(k, dtype=np.int64) * SEG
    at = [0]

    def region(n: int) -> np.ndarray:
        o = at[0]
        at[0] = (o + n + UNIT - 1) // UNIT * UNIT % (len(arena) - BUDGET)
        return arena[o:o + n]

    def save() -> E.EncodeJob:
        at[0] = 0
        job = eng.encode_columns_submit(classes, cls, ptrs, out_region=region, slot_align=UNIT)
        for f in list(eng.save.inflight):
            eng.save.finish(f)
        return job

    job = save()
    assert (job.fmt >= 0).all(), "every segment GPU-encoded"
    heads = np.stack([arena[a - arena.ctypes.data:a - arena.ctypes.data + HEADER_SIZE] for a in job.addr.tolist()])
    src = job.addr + HEADER_SIZE
    dst = (1 << 45) + np.arange(k, dtype=np.int64) * SEG
    orig = heads.view(HEADER_DTYPE).reshape(-1)["original_length"].astype(np.int64)

    def restore() -> None:
        j = eng.decode_columns_submit(heads, src, dst, orig, within=arena)
        for f in list(eng.restore.inflight):
            eng.restore.finish(f)
        assert all(r is None for r in j.results)

    if "--lines" in sys.argv:
        from line_profiler import LineProfiler
        lp = LineProfiler()
        for fn in (E.GpuCodecEngine.encode_columns_submit, E.GpuCodecEngine._run_encode_columns,
                   E.GpuCodecEngine._finish_encode_columns, E._write_headers, E._encode_rows, E._enc_offsets,
                   E._prefix_batches, E.GpuCodecEngine.decode_columns_submit, E.GpuCodecEngine._run_decode_columns,
                   E._decode_rows, E._mirror, E._header_cols):
            lp.add_function(fn)
        lp.runcall(lambda: [(save(), restore()) for _ in range(rounds)])
        lp.print_stats(output_unit=1e-6, stripzeros=True)
        return
    for name, fn in (("save", save), ("restore", restore)):
        best = min(_timed(fn) for _ in range(rounds))
        print(f"{codec} {name}: {k} segments, {best * 1e6:.0f} us per batch, {best / k * 1e6:.2f} us per segment")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
