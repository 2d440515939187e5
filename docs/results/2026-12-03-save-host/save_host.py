"""Host work of a GPU save, on a machine without a GPU: the Manager's save pipeline on its GPU path (encode
classes, gather table, ``encode_columns_submit``, headers, publish) with the GPU engine's streams, kernels and
copies replaced by no-ops, over the bench's geometry (36 layers, 16 blocks per chunk, 512 KiB segments,
shuffled blocks, 2,304 segments a save). What is left is the Python and numpy a save runs per batch, the
part that holds `turboquant-4`'s 512 KiB save below its bound on the H200 (the copy engine waits for the
host there, docs/results/2026-12-03-early-batch). The segments' bytes are not encoded (the arena's slots
keep what they held); their headers, CRCs of the zero accumulators, keys and index entries are made as on
the GPU path.

Usage: python save_host.py [--codec turboquant-4] [--repeat 40] [--profile OUT.txt] [--download]
``--download``: the download writes each flight's output region as the copy engine does (here the CPU fills it,
not counted): the header lines the host then writes are cold, as on the H200, not the lines the previous
save left in cache (../2026-12-03-gpu-suite).
Prints the median wall and thread CPU per save and per segment (the bench's repeats: invalidate all, save)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import threading
import time
import types
from typing import Iterator

import numpy as np

from orbitkv_fs.gpu import engine as E
from orbitkv_fs.gpu import headers as H
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.manager import device as D
from orbitkv_fs.manager.device import _geometry, _rows_of
from orbitkv_fs.tools import bench_pipeline as B

_spec = importlib.util.spec_from_file_location(
    "engine_host",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-02-gpu-host", "engine_host.py"))
engine_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_host)


class _Buf:
    """A cupy array's ``data.ptr``, over host memory."""

    def __init__(self, n: int) -> None:
        self.host = np.empty(max(n, 1), np.uint8)
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)


_NULL_EVENT = types.SimpleNamespace(synchronize=lambda: None, wait_event=lambda e: None)


class _Worker(engine_host.NullWorker):
    """../2026-12-02-gpu-host's null save Worker, with the block-copy table staged as ``Worker.copy_blocks``
    stages it (into one of three host buffers in turn) and nothing launched."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = [engine_host._Upload() for _ in range(3)]
        self.tables_next = 0
        # trees that scatter on a stream of their own make the kernel stream wait for it
        self.stream = self.scatters = _NULL_EVENT

    def copy_blocks(self, k, table, stream=None) -> None:
        j = self.tables_next
        self.tables_next = (j + 1) % len(self.tables)
        self.tables[j].get(table.nbytes)[:] = table.view(np.uint8)
        return _NULL_EVENT  # a restore's scatter answers the event after its copies

    def close(self) -> None:
        self.inflight.clear()


class _DownloadWorker(_Worker):
    """:class:`_Worker` whose download writes its bytes (zeros: the zero accumulators' meta, as before), the
    thread CPU it takes counted in ``filled`` (the GPU's copy engine does it there, not the host)."""

    filled = [0.0]

    def d2h(self, dst: np.ndarray, src: int, stream=None) -> None:
        c0 = time.thread_time()
        dst.fill(0)
        self.filled[0] += time.thread_time() - c0


class _HeaderModelWorker(_Worker):
    """:class:`_Worker` whose ``okv_write_headers`` runs its host model (``headers.write_headers_model``) on the
    flight's region at its download: headers a harness reads back (restore_host.py's save). Slow: not for
    timing a save."""

    def __init__(self) -> None:
        super().__init__()
        self.arrays: dict[int, np.ndarray] = {}
        self.pending = None

    def consts(self, cs, c, plan) -> tuple[int, int, int]:  # GpuCodecEngine._header_consts, on the host
        got = (E._header_rows(c, plan), np.ascontiguousarray(cs.templates), cs.bases.astype(np.uint32))
        for a in got:
            self.arrays[a.ctypes.data] = a
        return tuple(a.ctypes.data for a in got)

    def write_headers(self, k, rows: int, n: int, region: int, templates: int, bases: int) -> None:
        self.pending = (self.arrays[rows], self.arrays[templates], self.arrays[bases])

    def d2h(self, dst: np.ndarray, src: int, stream=None) -> None:
        if self.pending is not None:
            H.write_headers_model(dst, *self.pending)
            self.pending = None


def _codecs(worker: type = _Worker) -> D._GpuCodecs:
    """The Manager's GPU codecs over null engines (one per rotation seed, as ``_GpuCodecs.engine``)."""
    g = object.__new__(D._GpuCodecs)
    g._item, g._engines, g._lock = E.EncodeItem, {}, threading.Lock()

    def engine(seed: int) -> E.GpuCodecEngine:
        with g._lock:
            e = g._engines.get(seed)
            if e is None:
                e = g._engines[seed] = engine_host.null_engine(seed)
                e.save, e.restore = worker(), worker()
                if worker is _HeaderModelWorker:
                    e._header_consts = e.save.consts
                e._ans_packed = 1.0
                e.block_buffer = lambda nbytes, restore: _Buf(nbytes)
            return e

    g.engine = engine
    return g


@contextlib.contextmanager
def harness(codec: str, segment_kib: int = 512, download: bool = False,
            headers: bool = False) -> Iterator[types.SimpleNamespace]:
    """The bench's geometry on a Manager whose GPU codecs are null engines: ``m`` the Manager, ``e`` the
    registration, ``eng`` its engine state, ``chunks`` a save's chunks (shuffled blocks), ``nseg`` its
    segments. The pages file and the Manager go however the caller's block ends."""
    E._pinned_array = lambda n: np.zeros(max(n, 1), np.uint8)
    layers, blocks = 36, 512
    per = (segment_kib << 10) // B.BLOCK_BYTES
    order = np.arange(blocks)
    np.random.default_rng(1).shuffle(order)
    with contextlib.ExitStack() as stack:
        pages, reg = B._engine(blocks, layers)
        stack.callback(pages.close)
        m = stack.enter_context(Manager(ManagerConfig(
            pool_size=2 * blocks * B.BLOCK_BYTES * layers * 2 + (64 << 20), storage_codec=codec,
            storage_codec_budget=256 << 20)))
        stack.callback(setattr, m.dram.arena, "pinned", False)  # not registered with CUDA: nothing to unregister
        e = m.register_engine(reg)
        eng = m._engines[e.engine_id]
        for s in eng.segs:  # the host pages as GPU pages whose blocks the block-copy kernel moves
            s.copy = (int(s.base.ctypes.data), int(s.base.strides[0])) + _rows_of(s.block_shape, s.base.strides[1:],
                                                                                 s.dtype.itemsize)
        eng.geometry = _geometry(eng.segs)
        eng.info = types.SimpleNamespace(**{f: getattr(eng.info, f) for f in eng.info.__struct_fields__})
        eng.info.device = "cuda:0"
        m._gpu_codecs = _codecs(_DownloadWorker if download else
                                _HeaderModelWorker if headers and hasattr(E, "_header_rows") else _Worker)
        m.dram.arena.pinned = True
        chunks = [ChunkBlocks(chunk_key(f"x-{i}"), order[i * per:(i + 1) * per].tolist()) for i in range(blocks // per)]
        yield types.SimpleNamespace(m=m, e=e, eng=eng, chunks=chunks, nseg=len(chunks) * len(eng.segs))


def time_saves(h: types.SimpleNamespace, repeat: int, lp=None, profile: "str | None" = None) -> tuple[float, float]:
    """``repeat`` saves of ``h`` 's chunks (each after invalidating all): the median wall and thread CPU in us of the
    saves after the first two, less what the GPU would do (``_DownloadWorker.filled``); ``lp``, a line profiler
    enabled from the third save on, its report written to ``profile``."""
    walls, cpus = [], []
    for rep in range(repeat):
        h.m.invalidate(all=True)
        if lp is not None and rep == 2:
            lp.enable_by_count()
        f0 = _DownloadWorker.filled[0]
        t0, c0 = time.perf_counter(), time.thread_time()
        r = h.m.save(h.e.engine_id, h.chunks)
        filled = _DownloadWorker.filled[0] - f0  # the download's fill is the copy engine's work: not counted
        walls.append(time.perf_counter() - t0 - filled)
        cpus.append(time.thread_time() - c0 - filled)
        assert r.segments == h.nseg, r
    if lp is not None:
        lp.disable_by_count()
        with open(profile, "w") as f:
            lp.print_stats(stream=f, output_unit=1e-6, stripzeros=True)
    return float(np.median(walls[2:]) * 1e6), float(np.median(cpus[2:]) * 1e6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="turboquant-4")
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--segment-kib", type=int, default=512)
    p.add_argument("--profile", default=None, help="line_profiler of the save's batch steps, to this file")
    p.add_argument("--download", action="store_true", help="the download writes each flight's output region")
    args = p.parse_args()
    with harness(args.codec, args.segment_kib, args.download) as h:
        m, eng, nseg = h.m, h.eng, h.nseg
        lp = None
        if args.profile:
            from line_profiler import LineProfiler

            from lines_warm import FUNCS
            lp = LineProfiler()
            for f in FUNCS:
                lp.add_function(getattr(f, "__func__", f))
        w, c = time_saves(h, args.repeat, lp, args.profile)
        st = m._gpu_codecs.engine(eng.reg.rotation_seed).save.stats
        print(f"{args.codec} {args.segment_kib} KiB: {nseg} segments, {st['batches'] // args.repeat} engine flights"
              f" a save; median wall {w:.0f} us ({w / nseg:.2f} us/seg), thread CPU {c:.0f} us ({c / nseg:.2f} us/seg)")


if __name__ == "__main__":
    main()
