"""The GPU side of the pipelines: the adapter over the GPU codec engine and the device-memory helpers.

Primitives: :class:`_GpuCodecs` (one :class:`~orbitkv_fs.gpu.GpuCodecEngine` per rotation seed; encode
items or (``encode_class``, ``gather_rows``) of arrays, ``decode_submit`` / ``decode_finish`` of a restore
batch of items, ``decode_rows_submit`` / ``decode_rows_finish`` of one given as arrays, ``decode_device`` of
the direct path), :class:`_Targets` (a batch's sources or destinations in GPU pages as arrays; its places
found by :func:`_place`, numba, one pass over the pairs), :func:`_gather_batch` and :func:`_block_table` (a
batch's block copies as one kernel launch; their rows written by :func:`_block_rows`, numba, one pass over the
blocks), :func:`_device_run` / :func:`_run_of` (consecutive blocks used where they lie), :func:`_gather_host`,
:func:`_gather_device`, :func:`_to_host`, :func:`_gpu_present`.

Invariants: cupy and :mod:`orbitkv_fs.gpu` are imported only inside these functions, so the Manager stays
importable without them; a decode batch's temporary lives until the block copies that read it have run.
"""

from __future__ import annotations

import threading
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numba
import numpy as np

from ..header_rows import FORMAT_AT
from ..pages import BLOCK_COPY_DTYPE, cupy_dtype
from ..segment import Format, SegmentHeader
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


class _DecodeRows(NamedTuple):
    """One restore batch of rows between :meth:`_GpuCodecs.decode_rows_submit` and ``decode_rows_finish``."""

    engine: object
    job: object
    targets: "_Targets"
    ci: np.ndarray  # the rows' chunks and segments (of ``targets``)
    si: np.ndarray
    direct: np.ndarray  # rows decoded straight into their pages (the others into ``temp``, at ``pos``)
    temp: object  # device buffer on the restore stream: alive until the block copies have run
    pos: np.ndarray


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _place(ci: np.ndarray, si: np.ndarray, counts: np.ndarray, block_bytes: np.ndarray, run: np.ndarray,
           contig: np.ndarray, first: np.ndarray, geo: np.ndarray, mode: int, usable: np.ndarray, align: int,
           nbytes: np.ndarray, here: np.ndarray, dst: np.ndarray, pos: np.ndarray) -> tuple[int, int]:
    """:meth:`_Targets.places` in one pass over the pairs (``mode`` 0: none used where it lies, 1: any that can
    be, 2: those ``usable`` marks); ``pos`` gets the temporary's offsets of the others, in order. Answers the
    temporary's size and how many of ``pos`` were written; ``(-1, k)`` for a pair ``k`` out of range (bounds are
    checked first: boundscheck is off)."""
    for k in range(ci.shape[0]):
        if not (0 <= ci[k] < counts.shape[0] and 0 <= si[k] < geo.shape[0]):
            return -1, k
    size, m = 0, 0
    for k in range(ci.shape[0]):
        c, s = ci[k], si[k]
        nb = counts[c] * block_bytes[s]
        nbytes[k] = nb
        # uint64 arithmetic, as the pages' addresses are: an int64 mix would go through float64 in numba
        dst[k] = np.int64(geo[s, 0] + np.uint64(first[c]) * geo[s, 1])
        h = mode != 0 and run[c] and contig[s] and (mode == 1 or usable[k])
        here[k] = h
        if not h:
            pos[m] = size
            m += 1
            size += -(-nb // align) * align
    return size, m


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _layout(geo: np.ndarray, flat: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """:class:`_Targets`' per-segment and per-chunk columns in one pass: per segment its block bytes and whether a
    run of its blocks is one C-contiguous region (blocks back to back, each of regular contiguous rows); per
    chunk (``counts[c]`` of the blocks ``flat``, in order) its first block's place in ``flat``, that block (0
    for a chunk of none) and whether its blocks are one ascending run of real ids (:func:`_run_of`)."""
    m = geo.shape[0]
    block_bytes = np.empty(m, np.int64)
    contig = np.empty(m, np.bool_)
    for s in range(m):
        stride, rows, row, row_stride, nb = (np.int64(geo[s, 1]), np.int64(geo[s, 2]), np.int64(geo[s, 3]),
                                            np.int64(geo[s, 4]), np.int64(geo[s, 5]))
        block_bytes[s] = nb
        contig[s] = stride == nb and rows * row == nb and (rows == 1 or row_stride == row)
    c = counts.shape[0]
    start, first, run = np.empty(c, np.int64), np.zeros(c, np.int64), np.zeros(c, np.bool_)
    at = 0
    for i in range(c):
        start[i] = at
        n = counts[i]
        if n:
            b0 = flat[at]
            first[i] = b0
            ok = b0 >= 0
            for j in range(1, n):
                if not ok:
                    break
                ok = flat[at + j] == b0 + j
            run[i] = ok
        at += n
    return block_bytes, contig, start, first, run


class _Targets:
    """Where segments of GPU pages lie, as arrays over (chunk ``ci``, segment ``si``) pairs: a save's sources,
    a restore's destinations. A chunk whose blocks are one ascending run, of a segment whose blocks lie back
    to back, is used where it lies (its pages); the others go through one temporary per batch, which one
    block-copy launch gathers or scatters. Per segment its block geometry (``_Seg.copy``, kept by the engine's
    registration: :func:`_geometry`), per chunk its blocks (flattened), each read once."""

    def __init__(self, chunks: Sequence, segs: Sequence[_Seg], geo: "np.ndarray | None" = None) -> None:
        # per segment: block 0, block stride, rows, row bytes, row stride, block bytes, buffer address (0)
        self.geo = _geometry(segs) if geo is None else np.asarray(geo, dtype=np.uint64)
        blocks = list(map(_BLOCKS, chunks))
        self.counts = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
        self.flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int64, count=int(self.counts.sum()))
        self.block_bytes, self.contig, self.start, self.first, self.run = _layout(self.geo, self.flat, self.counts)

    @classmethod
    def of(cls, chunks: Sequence, segs: Sequence[_Seg], geo: "np.ndarray | None" = None) -> "_Targets | None":
        """The targets of chunks of GPU pages; None when some segment's blocks are not regular rows that the
        block-copy kernel moves (those take the per-item path)."""
        if not segs or any(s.copy is None for s in segs) or not all(ch.blocks for ch in chunks):
            return None
        return cls(chunks, segs, geo)

    def places(self, ci: np.ndarray, si: np.ndarray, *,
               direct: "bool | np.ndarray" = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """For pairs ``(ci, si)``: their bytes, which are used where they lie, the page address of those, and
        the others' offsets in a temporary of the size answered last (each at a multiple of _SLICE_ALIGN).
        ``direct=False``: none is used where it lies (all go through the temporary); an array: only the pairs
        it marks may be."""
        n = len(ci)
        nbytes, dst, pos = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        here = np.empty(n, dtype=bool)
        mode = 2 if isinstance(direct, np.ndarray) else int(direct is not False)
        usable = direct if mode == 2 else here  # here: not read (mode 0 or 1)
        size, staged = _place(np.asarray(ci, np.int64), np.asarray(si, np.int64), self.counts, self.block_bytes,
                              self.run, self.contig, self.first, self.geo, mode, usable, _SLICE_ALIGN,
                              nbytes, here, dst, pos)
        if size < 0:
            raise IndexError(f"pair {staged}: chunk {int(ci[staged])} or segment {int(si[staged])} is not a target")
        return nbytes, here, dst, pos[:staged], size

    def table(self, ci: np.ndarray, si: np.ndarray, addr: np.ndarray, *, gather: bool) -> np.ndarray:
        """Block-copy rows between pairs' blocks and their contiguous bytes at device addresses ``addr``:
        pages to those when ``gather``, else those to pages."""
        return _rows_table(self.geo, si, addr, self.flat, self.start, self.counts, ci, gather)


_BLOCKS = attrgetter("blocks")  # a ChunkBlocks' block ids


def _geometry(segs: Sequence[_Seg]) -> np.ndarray:
    """Per segment (all of GPU pages the block-copy kernel moves): block 0, block stride, rows, row bytes,
    row stride, block bytes and a zero buffer address, ``[n, 7]`` uint64."""
    return np.array([s.copy + (s.block_bytes, 0) for s in segs], dtype=np.uint64).reshape(len(segs), 7)


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

    def encode_class(self, engine, seg: _Seg, blocks: int):
        """``engine`` 's encode class (``encode_class``) of ``seg`` 's segments of chunks of ``blocks`` blocks."""
        from ..gpu.engine import DeviceSpan

        return engine.encode_class(self.item(DeviceSpan(0, blocks * seg.block_bytes, (blocks,) + seg.block_shape), seg))

    def items_of(self, ptrs: np.ndarray, targets: "_Targets", ci: np.ndarray, si: np.ndarray, segs: Sequence[_Seg]) -> list:
        """Encode items of pairs ``(ci, si)`` whose bytes lie at device addresses ``ptrs`` (what
        :meth:`gather_rows` answered), for ``encode_submit``."""
        from ..gpu.engine import DeviceSpan

        counts = targets.counts[ci].tolist()
        return [self.item(DeviceSpan(p, n * segs[s].block_bytes, (n,) + segs[s].block_shape), segs[s])
                for p, n, s in zip(ptrs.tolist(), counts, si.tolist())]

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

    def decode_rows_submit(self, targets: _Targets, rows: np.ndarray, heads: np.ndarray, src: np.ndarray,
                           seed: int, *, within: "np.ndarray | None" = None,
                           direct: bool = True) -> "_DecodeRows | None":
        """Start decoding restore ``rows`` (of ``targets``) given as arrays: their verified header rows and the
        pinned host address of each payload, lying in ``within`` (the arena; ANS chunk tables are read from it)
        (the engine's ``decode_columns_submit``, no Python per row). None (nothing started) when the engine
        leaves the batch to :meth:`decode_submit` (a segment over half its workspace, or ANS without
        ``within``). ``direct=False``: every row is decoded into the temporary, none into its pages, so that
        nothing is written to the engine's pages before :meth:`decode_rows_finish`. ANS rows always go through
        the temporary, which nvCOMP writes in place (``decode_columns_submit(in_place=True)``): a failed row's
        bytes there are never copied, and the workspace holds their payloads alone."""
        engine = self.engine(seed)
        ci, si = np.divmod(rows, len(targets.geo))
        ans = heads[:, FORMAT_AT] == Format.ANS
        if direct and ans.any():
            direct = ~ans
        nbytes, direct_rows, dst, pos, size = targets.places(ci, si, direct=direct)
        temp = None
        if size:
            temp = engine.block_buffer(size, restore=True)
            dst[~direct_rows] = int(temp.data.ptr) + pos
        job = engine.decode_columns_submit(heads, src, dst, nbytes, within=within, in_place=True)
        return None if job is None else _DecodeRows(engine, job, targets, ci, si, direct_rows, temp, pos)

    def decode_rows_finish(self, db: _DecodeRows) -> tuple[list, object]:
        """Wait for a :meth:`decode_rows_submit` and queue the block copies of its rows decoded into the
        temporary: the error (or None) per row, and the CUDA event after the copies (None when none)."""
        errs: list = list(db.engine.decode_collect(db.job))
        staged = ~db.direct
        if not staged.any():
            return errs, None
        pos = db.pos
        if errs.count(None) != len(errs):
            ok = np.fromiter((e is None for e in errs), dtype=bool, count=len(errs))
            pos, staged = pos[ok[staged]], staged & ok
            if not staged.any():
                return errs, None
        table = db.targets.table(db.ci[staged], db.si[staged], int(db.temp.data.ptr) + pos, gather=False)
        return errs, db.engine.scatter_blocks(table)

    def gather_rows(self, engine, targets: _Targets, ci: np.ndarray, si: np.ndarray) -> tuple[np.ndarray, object]:
        """The device address of each pair's bytes as one contiguous region, for ``engine`` to encode: a run
        of a chunk's blocks where it lies, the others gathered into one buffer by one block-copy launch on the
        save stream. Answers the addresses and that buffer (None when there is none), which must live until
        the encode that reads it is collected."""
        _, direct, ptrs, pos, size = targets.places(ci, si)
        if not size:
            return ptrs, None
        buf = engine.block_buffer(size, restore=False)
        addr = int(buf.data.ptr) + pos
        ptrs[~direct] = addr
        engine.gather_blocks(targets.table(ci[~direct], si[~direct], addr, gather=True))
        return ptrs, buf

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
    if not int(counts.sum()):
        return np.empty(0, dtype=BLOCK_COPY_DTYPE)
    # All (layer, role) segments of a chunk share its block list: each list is converted once.
    arrays: dict[int, np.ndarray] = {}
    for _, b, _ in items:
        if id(b) not in arrays:
            arrays[id(b)] = np.array(b, dtype=np.int64)
    ids = np.concatenate([arrays[id(b)] for _, b, _ in items])
    # per item: block 0, block stride, rows, row bytes, row stride (seg.copy), block bytes, buffer address
    geo = np.array([seg.copy + (seg.block_bytes, addr) for seg, _, addr in items], dtype=np.uint64)
    return _table_of(geo, ids, counts, gather=gather)


def _table_of(geo: np.ndarray, ids: np.ndarray, counts: np.ndarray, *, gather: bool,
              starts: "np.ndarray | None" = None) -> np.ndarray:
    """Block-copy rows of items whose geometry rows are ``geo`` (``[m, 7]``: block 0, block stride, rows,
    row bytes, row stride, block bytes, buffer address) and blocks ``ids`` (``counts[i]`` of them per item
    from ``starts[i]``; default: concatenated in item order); see :func:`_block_table`."""
    counts = np.asarray(counts, dtype=np.int64)
    if starts is None:
        starts = np.cumsum(counts) - counts
    geo = np.ascontiguousarray(geo, dtype=np.uint64)
    every = np.arange(len(counts))
    return _rows_table(geo, every, geo[:, 6], np.asarray(ids, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                       counts, every, gather)


def _rows_table(geo: np.ndarray, gi: np.ndarray, addr: np.ndarray, ids: np.ndarray, starts: np.ndarray,
                counts: np.ndarray, ci: np.ndarray, gather: bool) -> np.ndarray:
    """:func:`_block_rows` as ``BLOCK_COPY_DTYPE`` rows; IndexError for an item whose rows lie outside the
    arrays given."""
    out = _block_rows(geo, np.asarray(gi, np.int64), np.asarray(addr, np.uint64), ids, starts, counts,
                      np.asarray(ci, np.int64), gather, SKIP_BLOCK)
    if out.shape[1] == 0:
        raise IndexError(f"item {len(out)}: its geometry row or its blocks are out of range")
    return out.view(BLOCK_COPY_DTYPE).reshape(-1)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _block_rows(geo: np.ndarray, gi: np.ndarray, addr: np.ndarray, ids: np.ndarray, starts: np.ndarray,
                counts: np.ndarray, ci: np.ndarray, gather: bool, skip: int) -> np.ndarray:
    """The block-copy rows of items ``p``: geometry row ``geo[gi[p]]`` (uint64: block 0, block stride, rows, row
    bytes, row stride, block bytes), contiguous bytes at ``addr[p]``, the blocks ``ids[starts[c]:][:counts[c]]``
    of ``c = ci[p]``; as five uint64 words (src, dst, src stride, dst stride, rows | row bytes << 32), one pass
    over the blocks. A scatter leaves out ``skip`` positions. Bounds are checked first (boundscheck is off): an
    item out of range answers a ``(p, 0)`` array."""
    total = 0
    for p in range(gi.shape[0]):
        c, g = ci[p], gi[p]
        if not (0 <= c < counts.shape[0] and 0 <= g < geo.shape[0] and 0 <= starts[c]
                and starts[c] + counts[c] <= ids.shape[0]):
            return np.empty((p, 0), np.uint64)
        total += counts[c]
    out = np.empty((total, 5), np.uint64)
    r = 0
    for p in range(gi.shape[0]):
        g, c = gi[p], ci[p]
        first, stride, rows, row_bytes, row_stride, block_bytes = (
            geo[g, 0], geo[g, 1], geo[g, 2], geo[g, 3], geo[g, 4], geo[g, 5])
        at, base = starts[c], addr[p]
        for b in range(counts[c]):
            blk = ids[at + b]
            if not gather and blk == skip:
                continue
            # uint64 arithmetic, as the pages' addresses are (a negative id is SKIP_BLOCK, left out of scatters)
            page, flat = first + np.uint64(blk) * stride, base + np.uint64(b) * block_bytes
            if gather:
                out[r, 0], out[r, 1], out[r, 2], out[r, 3] = page, flat, row_stride, row_bytes
            else:
                out[r, 0], out[r, 1], out[r, 2], out[r, 3] = flat, page, row_bytes, row_stride
            out[r, 4] = rows | (row_bytes << np.uint64(32))
            r += 1
    return out[:r]


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
        from ..gpu import unusable_reason  # the package's own import is free of cupy
    except ImportError:  # the core imported from a source tree, without setup.py's mapping of gpu/
        return False
    return unusable_reason() is None


def _to_host(src, dst: np.ndarray) -> None:
    """Copy an engine block view (numpy, or cupy on a GPU) into the host array ``dst``."""
    if isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        import cupy

        cupy.ascontiguousarray(src).get(out=dst.view(src.dtype))
