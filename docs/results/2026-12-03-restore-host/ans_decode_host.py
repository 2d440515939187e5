"""The GPU engine's host work for an `ans` restore batch, without a GPU: ``decode_columns_submit`` of one Manager
batch as the pipeline bench's 512 KiB restores make them (512 KiB BF16 segments, eight 64 KiB nvCOMP chunks each
at 0.7 of their bytes, laid out as a save leaves them in the arena), with the worker's CUDA calls and nvCOMP as
no-ops and the flights dropped unfinished (their verdicts are not timed). Needs cupy importable, not a GPU.

Usage: python ans_decode_host.py [--segments 230] [--repeat 200] [--in-place] [--profile OUT.txt]
Prints microseconds per batch (best and median) and per segment, and the engine flights a batch makes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
import types

import ml_dtypes
import numpy as np

from orbitkv_fs.gpu import ans_format
from orbitkv_fs.gpu import engine as E
from orbitkv_fs.gpu.tables import zero_crc
from orbitkv_fs.segment import HEADER_SIZE, AnsType, Format, Role, SegmentHeader, pack_header

_spec = importlib.util.spec_from_file_location(
    "engine_host",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-02-gpu-host", "engine_host.py"))
engine_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_host)

SEGMENT = 512 << 10


class _Worker(engine_host.NullWorker):
    """The null restore worker, its flights dropped when a third is placed (no verdicts: the null GPU's answers
    would fail every segment, and the submit is what is timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = types.SimpleNamespace(ptr=0)  # nvCOMP's calls name the stream

    def place(self, nbytes: int):
        while len(self.inflight) > 1:
            self.inflight.pop(0)
        return self.ws.ptr, self.uploads[len(self.inflight)]


def _arena(k: int, rng: np.random.Generator) -> "tuple[np.ndarray, np.ndarray]":
    """``k`` ANS segments in a pinned-like array, 512-byte slots one after another, and their offsets."""
    nch = ans_format.chunk_count(SEGMENT)
    blobs = []
    for i in range(k):
        sizes = (rng.uniform(0.65, 0.75, nch) * ans_format.CHUNK_BYTES).astype(np.int64) // 8 * 8
        payload = ans_format.pack([bytes(int(n)) for n in sizes])
        h = SegmentHeader(Format.ANS, np.dtype(ml_dtypes.bfloat16), SEGMENT, len(payload),
                          int(zero_crc(np.array([len(payload)]))[0]), role=Role(i % 2), layer=i // 2 % 36,
                          ans_type=AnsType.FLOAT16)
        blobs.append(pack_header(h) + payload)
    offs = np.cumsum([0] + [-(-len(b) // 512) * 512 for b in blobs])
    arena = np.zeros(int(offs[-1]), np.uint8)
    for o, b in zip(offs.tolist(), blobs):
        arena[o:o + len(b)] = np.frombuffer(b, np.uint8)
    return arena, offs[:-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=230)  # a 512 KiB `ans` restore batch of the bench's Manager
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--in-place", action="store_true", help="nvCOMP writes the destinations (the Manager's call)")
    ap.add_argument("--profile", default=None, help="line_profiler of the decode's batch steps, to this file")
    a = ap.parse_args()
    E._pinned_array = lambda n: np.zeros(max(n, 1), np.uint8)
    eng = engine_host.null_engine()
    eng.restore = _Worker()
    eng._nvcomp = types.SimpleNamespace(decompress_temp_bytes=lambda chunks, chunk, total, t: 16 * chunks + total // 64,
                                        decompress=lambda *args: None)
    arena, offs = _arena(a.segments, np.random.default_rng(3))
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs.tolist()])
    src = arena.ctypes.data + offs + HEADER_SIZE
    dst = (1 << 42) + np.arange(a.segments, dtype=np.int64) * SEGMENT
    orig = np.full(a.segments, SEGMENT, dtype=np.int64)
    lp = None
    if a.profile:
        from line_profiler import LineProfiler

        lp = LineProfiler()
        for f in (E.GpuCodecEngine.decode_columns_submit, E.GpuCodecEngine._run_decode_columns, E._temp_batches):
            lp.add_function(f)
    times, flights = [], 0
    for rep in range(a.repeat):
        if lp is not None and rep == 3:
            lp.enable_by_count()
        t0 = time.perf_counter()
        job = eng.decode_columns_submit(heads, src, dst, orig, within=arena, **({"in_place": True} if a.in_place else {}))
        times.append(time.perf_counter() - t0)
        flights = len(job.flights)
    if lp is not None:
        lp.disable_by_count()
        with open(a.profile, "w") as f:
            lp.print_stats(stream=f, output_unit=1e-6, stripzeros=True)
    m = statistics.median(times[3:])
    print(f"ans, {a.segments} segments a batch, {flights} engine flights, {a.repeat} repeats: decode_columns_submit "
          f"{min(times) * 1e6:.1f} / {m * 1e6:.1f} us per batch (best / median), {m * 1e6 / a.segments:.2f} us/seg")


if __name__ == "__main__":
    main()
