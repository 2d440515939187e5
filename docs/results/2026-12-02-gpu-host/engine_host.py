"""The GPU engine's host work per batch, without a GPU: ``encode_columns_submit`` + ``encode_collect`` and
``decode_columns_submit`` + ``decode_collect`` of one batch shaped as the pipeline bench's (36 layers, K and V,
512 KiB segments of 16 blocks of 8 x 128 BF16 heads; `turboquant-4` keeps four layers exact), with the worker's
CUDA calls (copies, launches, events) replaced by no-ops, so that what is timed is the Python and numpy a
batch costs the host. Needs cupy importable (the engine module imports it), not a GPU.

Usage: python engine_host.py [--codec fp8|turboquant-4|none] [--segments 461] [--repeat 300]
Prints microseconds per batch (best and median of --repeat) for each part."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import types
from collections import Counter

import ml_dtypes
import numpy as np

from orbitkv_fs.gpu import engine as E
from orbitkv_fs.gpu.tables import zero_crc
from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, RawReason, Role

BF16 = np.dtype(ml_dtypes.bfloat16)
LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS, BLOCKS = 36, 8, 128, 16, 16


class _Upload:
    def __init__(self) -> None:
        self.arr = np.zeros(64 << 20, np.uint8)

    def get(self, n: int) -> np.ndarray:
        return self.arr[:n]


class NullWorker:
    """The Worker's interface with no CUDA behind it: a batch's flight finishes when asked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.inflight: list = []
        self.uploads = (_Upload(), _Upload())
        self.stream = self.copies = None
        self.ws = types.SimpleNamespace(ptr=1 << 40, size=1 << 30, budget=1 << 30)

    def wait_for_current(self) -> None:
        pass

    def place(self, nbytes: int):
        while len(self.inflight) > 1:
            self.finish(self.inflight[0])
        return self.ws.ptr, self.uploads[len(self.inflight)]

    def h2d(self, *a, **k) -> None:
        pass

    h2d_raw = d2h = handoff = h2d

    def launch(self, *a, **k) -> None:
        self.stats["launches"] += 1

    write_headers = launch  # okv_write_headers: the GPU writes a flight's headers, the host only launches it

    def launched(self, base, nbytes, upload, finish, last=None):
        f = E._Flight(0, nbytes, 0, None, finish)
        self.inflight.append(f)
        return f

    def finish(self, f) -> None:
        if f in self.inflight:
            self.inflight.remove(f)
            f.finish()

    def drop(self, flights) -> None:
        for f in flights:
            if f in self.inflight:
                self.inflight.remove(f)


def null_engine(seed: int = 7) -> E.GpuCodecEngine:
    eng = object.__new__(E.GpuCodecEngine)
    eng.budget_bytes, eng.seed = 256 << 20, seed
    eng._classes, eng._rows, eng._class_sets, eng._plans, eng._dec_plans = {}, {}, {}, {}, {}
    eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
    eng.save, eng.restore = NullWorker(), NullWorker()
    eng._nvcomp = None
    if hasattr(E, "_header_rows"):  # trees whose GPU writes the headers: their device inputs, one lookup a flight
        memo: dict = {}
        eng._header_consts = lambda cs, c, plan: memo.setdefault(id(plan), (0, 0, 0))
    return eng


def classes_of(eng: E.GpuCodecEngine, codec: str) -> list:
    """One class per (layer, role), in the Manager's segment order: what ``encode_class`` answers there."""
    out = []
    n = BLOCKS * BLOCK_TOKENS * HEADS * HEAD_DIM * 2
    for layer in range(LAYERS):
        for role in (Role.KEY, Role.VALUE):
            exact = codec == "turboquant-4" and (layer < 2 or layer >= LAYERS - 2)
            item = E.EncodeItem(E.DeviceSpan(0, n, (BLOCKS * BLOCK_TOKENS, HEADS, HEAD_DIM)),
                                "none" if exact or codec == "none" else codec, role, layer, BF16,
                                RawReason.POLICY if exact else RawReason.NONE)
            out.append(eng._classify(0, item))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="turboquant-4")
    ap.add_argument("--segments", type=int, default=461)
    ap.add_argument("--repeat", type=int, default=300)
    a = ap.parse_args()
    E._pinned_array = lambda n: np.zeros(max(n, 1), np.uint8)  # the decode's meta download: no pinned pool here
    eng = null_engine()
    classes = classes_of(eng, a.codec)
    k = a.segments
    cls = np.arange(k, dtype=np.int64) % len(classes)
    ptrs = (1 << 41) + np.arange(k, dtype=np.int64) * (1 << 20)
    arena = np.zeros(512 << 20, np.uint8)

    def region(n: int) -> np.ndarray:
        return arena[:n]

    times: dict[str, list[float]] = {"encode_columns_submit": [], "encode_collect": [],
                                     "decode_columns_submit": [], "decode_collect": []}
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        job = eng.encode_columns_submit(classes, cls, ptrs, out_region=region, slot_align=512)  # the arena unit (tiers.dram.UNIT)
        t1 = time.perf_counter()
        eng.encode_collect(job)
        t2 = time.perf_counter()
        times["encode_columns_submit"].append(t1 - t0)
        times["encode_collect"].append(t2 - t1)
    # the decode of what the encode wrote: headers from the arena, payload CRCs that the null kernels' zero
    # accumulators match (the CRC of n zero bytes), so that no segment takes the mismatch path
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in (job.addr - arena.ctypes.data).tolist()])
    h = heads.view(HEADER_DTYPE).reshape(-1)
    h["payload_crc"] = zero_crc(h["stored_length"].astype(np.int64))
    src = job.addr + HEADER_SIZE
    dst = (1 << 42) + np.arange(k, dtype=np.int64) * (1 << 20)
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        djob = eng.decode_columns_submit(heads, src, dst, h["original_length"].astype(np.int64))
        t1 = time.perf_counter()
        res = eng.decode_collect(djob)
        t2 = time.perf_counter()
        times["decode_columns_submit"].append(t1 - t0)
        times["decode_collect"].append(t2 - t1)
    assert all(r is None for r in res), [r for r in res if r is not None][:3]
    print(f"{a.codec}, {k} segments a batch, {a.repeat} repeats: us per batch (best / median), us per segment (median)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<24} {min(ts) * 1e6:8.1f} / {m * 1e6:8.1f}   {m * 1e6 / k:6.2f}")


if __name__ == "__main__":
    main()
