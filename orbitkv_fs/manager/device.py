"""The GPU side of the pipelines: the adapter over the GPU codec engine and the device-memory helpers.

Primitives: :class:`_GpuCodecs` (one :class:`~orbitkv_fs.gpu.GpuCodecEngine` per rotation seed; encode
items, ``decode_submit`` / ``decode_finish`` of a restore batch, ``decode_device`` of the direct path),
:func:`_gather_batch` and :func:`_block_table` (a batch's block copies as one kernel launch),
:func:`_device_run` / :func:`_run_of` (consecutive blocks used where they lie), :func:`_gather_host`,
:func:`_gather_device`, :func:`_to_host`, :func:`_gpu_present`.

Invariants: cupy and :mod:`orbitkv_fs.gpu` are imported only inside these functions, so the Manager stays
importable without them; a decode batch's temporary lives until the block copies that read it have run.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..pages import BLOCK_COPY_DTYPE, cupy_dtype
from ..segment import SegmentHeader
from .api import SKIP_BLOCK

if TYPE_CHECKING:
    from .registry import _Seg


# Offsets of a batch's gathered segments inside their one device buffer: aligned for the kernels' wide loads.
_SLICE_ALIGN = 256


class _DecodeBatch:
    """One restore batch between :meth:`_GpuCodecs.decode_submit` and :meth:`_GpuCodecs.decode_finish`."""

    __slots__ = ("engine", "items", "staged", "temp", "dsts", "job")

    def __init__(self, engine, items: list) -> None:
        self.engine = engine
        self.items = items
        self.staged: list[tuple[int, int]] = []  # (item, offset in temp): decoded there, then copied to blocks
        self.temp = None  # device buffer on the restore stream: alive until the block copies have run
        self.dsts: list = []
        self.job = None


class _GpuCodecs:
    """The GPU codec engine (:mod:`orbitkv_fs.gpu`) behind the two calls the pipeline makes: encode a
    batch of device arrays into segments, decode one segment into a chunk's blocks. One engine per
    rotation seed (the engine's TurboQuant signs depend on it)."""

    def __init__(self, budget: int) -> None:
        from ..gpu import EncodeItem, GpuCodecEngine
        from ..gpu.module import check_device

        check_device()
        self._item = EncodeItem
        self._cls = GpuCodecEngine
        self._budget = budget
        self._engines: dict[int, object] = {}
        self._lock = threading.Lock()

    def engine(self, seed: int):
        """The engine of rotation seed ``seed`` (made on first use)."""
        with self._lock:
            e = self._engines.get(seed)
            if e is None:
                e = self._engines[seed] = self._cls(budget_bytes=self._budget, seed=seed)
            return e

    def item(self, array, seg: _Seg):
        """The engine's encode item for ``array`` (a gathered segment source) of ``seg``."""
        return self._item(array, seg.codec_name, seg.role, seg.layer, seg.dtype, seg.raw_reason)

    def decode_device(self, segments: list, destinations: list, seed: int) -> list:
        """``decode_batch`` of segments in device memory into device destinations (complete on return)."""
        return self.engine(seed).decode_batch(segments, destinations)

    def decode_submit(self, items: list[tuple[_Seg, list[int], memoryview, SegmentHeader]], seed: int,
                      pinned: Sequence[bool] | None = None) -> "_DecodeBatch":
        """Start decoding ``(seg, blocks, segment bytes, its verified header)`` items with one
        ``decode_submit``; :meth:`decode_finish` then scatters them into their chunks' blocks. ``pinned[i]``:
        item i's bytes are in pinned memory (the arena) and go to the GPU from there."""
        from ..gpu.engine import DeviceSpan

        # A chunk whose blocks are one contiguous stretch of GPU pages is decoded straight into them (the
        # engine leaves a destination untouched when its segment fails the CRC32C check). The others land
        # in one temporary and go to their blocks with one block-copy launch for the batch (GPU pages), or
        # a copy per segment (host pages, irregular layouts: these get cupy views of the temporary).
        engine = self.engine(seed)
        db = _DecodeBatch(engine, items)
        dsts: list = [None] * len(items)
        size = 0
        for i, (seg, blocks, _, _) in enumerate(items):
            dsts[i] = _device_run(seg, blocks)
            if dsts[i] is None:
                db.staged.append((i, size))
                size = -(-(size + len(blocks) * seg.block_bytes) // _SLICE_ALIGN) * _SLICE_ALIGN
        if db.staged:
            db.temp = engine.block_buffer(size, restore=True)
            addr = int(db.temp.data.ptr)
            for i, pos in db.staged:
                seg, blocks, _, _ = items[i]
                n = len(blocks) * seg.block_bytes
                dsts[i] = (DeviceSpan(addr + pos, n) if seg.copy is not None else
                           db.temp[pos:pos + n].view(cupy_dtype(seg.dtype)).reshape((len(blocks),) + seg.block_shape))
        db.dsts = dsts
        db.job = engine.decode_submit([blob for _, _, blob, _ in items], dsts, pinned=pinned,
                                      headers=[h for *_, h in items])
        return db

    def decode_finish(self, db: "_DecodeBatch") -> tuple[list, object]:
        """Wait for a submitted decode and queue each decoded item's copy into its blocks: the error (or None)
        per item, and the CUDA event after the block copies (None when none were queued). Host pages and
        irregular GPU layouts are written here (the latter by cupy on the current stream, which the caller
        synchronises)."""
        errs: list = list(db.engine.decode_collect(db.job))
        kernel: list[tuple[_Seg, list[int], int]] = []
        addr = int(db.temp.data.ptr) if db.temp is not None else 0
        for i, pos in db.staged:
            seg, blocks, _, _ = db.items[i]
            if errs[i] is not None:
                continue
            if seg.copy is not None:
                kernel.append((seg, blocks, addr + pos))
                continue
            try:
                if seg.on_host:  # host pages (maybe strided: no get(out=))
                    seg.scatter(blocks, db.dsts[i].get().view(seg.dtype))
                else:
                    seg.scatter(blocks, db.dsts[i])
            except Exception as e:
                errs[i] = e
        return errs, (db.engine.scatter_blocks(_block_table(kernel, gather=False)) if kernel else None)

    def stats(self) -> dict[str, int]:
        """The engines' counters (``GpuCodecEngine.stats`` names), summed over rotation seeds."""
        out: dict[str, int] = {}
        with self._lock:
            engines = list(self._engines.values())
        for e in engines:
            for k, v in e.stats.items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def close(self) -> None:
        with self._lock:
            for e in self._engines.values():
                e.close()
            self._engines.clear()


def _gather_host(seg: _Seg, blocks: list[int]) -> np.ndarray:
    """The chunk's blocks of ``seg`` as one contiguous host array of the segment's dtype."""
    x = seg.gather(blocks)
    return x if isinstance(x, np.ndarray) else x.get().view(seg.dtype)


def _gather_device(seg: _Seg, blocks: list[int]):
    """The chunk's blocks of ``seg`` as one contiguous cupy array (host pages are uploaded)."""
    import cupy

    x = seg.gather(blocks)
    if isinstance(x, np.ndarray):
        return cupy.asarray(x.view(cupy_dtype(x.dtype)))
    return x


def _gather_batch(items: list[tuple[_Seg, list[int]]], buffer, gather_blocks) -> tuple[list, object]:
    """Each item's blocks as one contiguous device region (a cupy array or a ``DeviceSpan``), in order,
    and the buffer holding the spans (None when there are none). Consecutive blocks of a contiguous layout
    are used where they lie; the others land in one ``buffer(nbytes)``, all moved by
    ``gather_blocks(table)`` (the GPU engine's block-copy kernel: one launch per batch)."""
    out: list = [None] * len(items)
    pending: list[tuple[int, int]] = []  # (item, offset in the buffer)
    size = 0
    for i, (seg, blocks) in enumerate(items):
        run = _device_run(seg, blocks)
        if run is not None:  # the pages themselves are the sources: no gather at all
            out[i] = run
        elif seg.copy is None:
            out[i] = seg.gather(blocks)
        else:
            pending.append((i, size))
            size = -(-(size + len(blocks) * seg.block_bytes) // _SLICE_ALIGN) * _SLICE_ALIGN
    if not pending:
        return out, None
    from ..gpu.engine import DeviceSpan

    buf = buffer(size)
    addr = int(buf.data.ptr)
    for i, pos in pending:
        seg, blocks = items[i]
        out[i] = DeviceSpan(addr + pos, len(blocks) * seg.block_bytes, (len(blocks),) + seg.block_shape)
    gather_blocks(_block_table([(items[i][0], items[i][1], addr + pos) for i, pos in pending], gather=True))
    return out, buf


def _block_table(items: list[tuple[_Seg, Sequence[int], int]], *, gather: bool) -> np.ndarray:
    """Block-copy rows (``BLOCK_COPY_DTYPE``) between each item's page blocks and a contiguous device
    buffer at the item's address: pages to buffer when ``gather``, else buffer to pages (no row for a
    :data:`SKIP_BLOCK` position, whose part of the buffer stays where it is). Built for the whole batch at
    once (a numpy pass per field, not per item)."""
    counts = np.fromiter((len(b) for _, b, _ in items), dtype=np.int64, count=len(items))
    total = int(counts.sum())
    table = np.empty(total, dtype=BLOCK_COPY_DTYPE)
    if not total:
        return table
    # All (layer, role) segments of a chunk share its block list: each list is converted once.
    arrays: dict[int, np.ndarray] = {}
    for _, b, _ in items:
        if id(b) not in arrays:
            arrays[id(b)] = np.array(b, dtype=np.int64)
    ids = np.concatenate([arrays[id(b)] for _, b, _ in items])
    keep = None if gather or ids.min() >= 0 else ids != SKIP_BLOCK
    ids = ids.astype(np.uint64)
    # per item: block 0, block stride, rows, row bytes, row stride (seg.copy), block bytes, buffer address
    geo = np.repeat(np.array([seg.copy + (seg.block_bytes, addr) for seg, _, addr in items], dtype=np.uint64),
                    counts, axis=0)
    within = np.arange(total, dtype=np.uint64) - np.repeat((np.cumsum(counts) - counts).astype(np.uint64), counts)
    pages = geo[:, 0] + ids * geo[:, 1]
    flat = geo[:, 6] + within * geo[:, 5]
    table["src"], table["dst"] = (pages, flat) if gather else (flat, pages)
    table["src_stride"], table["dst_stride"] = (geo[:, 4], geo[:, 3]) if gather else (geo[:, 3], geo[:, 4])
    table["rows"], table["row_bytes"] = geo[:, 2], geo[:, 3]
    return table if keep is None else table[keep]


def _rows_of(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int, int] | None:
    """A block of ``shape`` / ``strides`` (bytes) as (rows, row bytes, row stride): its innermost
    contiguous run of dimensions is a row, the outer dimensions must step by one regular stride.
    None when they do not (the block then moves with cupy instead)."""
    row, d = itemsize, len(shape)
    while d and (shape[d - 1] == 1 or strides[d - 1] == row):
        row *= shape[d - 1]
        d -= 1
    rows, step = 1, row
    for k in range(d - 1, -1, -1):
        if shape[k] == 1:
            continue
        if rows == 1:
            step = strides[k]
        elif strides[k] != step * rows:
            return None
        rows *= shape[k]
    if step <= 0:
        return None
    return rows, row, step


def _device_run(seg: _Seg, blocks: Sequence[int]):
    """The GPU pages of ``blocks`` as one C-contiguous device array, when they are consecutive blocks of a
    layout whose blocks are contiguous in memory (``separate``, ``sglang_token_pool``); else None."""
    if seg.base is None or isinstance(seg.base, np.ndarray):
        return None
    run = _run_of(blocks)
    if run is None:
        return None
    view = seg.base[run]
    return view if view.flags.c_contiguous else None


def _run_of(blocks: Sequence[int]) -> slice | None:
    """``blocks`` as a slice when they are consecutive ascending ids (engines often allocate a chunk's
    blocks together), else None (also when one is :data:`SKIP_BLOCK`)."""
    first, n = blocks[0], len(blocks)
    if first >= 0 and blocks[-1] - first == n - 1 and (n < 3 or all(b == first + j for j, b in enumerate(blocks))):
        return slice(first, first + n)
    return None


def _array_module(a):
    """numpy for host arrays, cupy for device ones (cupy imported only when a device array is here)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def _gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


def _to_host(src, dst: np.ndarray) -> None:
    """Copy an engine block view (numpy, or cupy on a GPU) into the host array ``dst``."""
    if isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        import cupy

        cupy.ascontiguousarray(src).get(out=dst.view(src.dtype))
