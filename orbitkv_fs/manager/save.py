"""The save pipeline: engine pages -> segments -> DRAM (or straight to the lower tier).

Primitives: :meth:`SavePipeline.save`, :meth:`~SavePipeline._save_items` (the segments not cached yet, a
chunk at a time, keys and sizes from the engine's :class:`SavePlan`), :class:`SaveRows` (a codec batch as
columns: its chunks, and per segment its chunk, segment index and key),
exact segments of host pages go to :meth:`~orbitkv_fs.manager.hostpath.HostPath._save_raw_batch`,
:meth:`~SavePipeline._save_submit` / :meth:`~SavePipeline._save_finish` / :meth:`~SavePipeline._save_abort`
(one codec batch: gather and encode, then publish), :meth:`~SavePipeline._save_columns` (a batch of GPU
pages for the engine: encode classes, sources), :meth:`~SavePipeline._ssd_direct_sink` (the cuFile
direct path), :meth:`~SavePipeline._demote_direct` (DRAM full of leased objects). :class:`_SaveAcc` sums
a request's admissions; :class:`_SaveBatch` is one batch in flight.

Invariants: a segment is published only after its bytes and header (with its CRC32C) are in place; a batch
that fails returns every arena extent and workspace byte it reserved; chunks present in full are skipped.
"""

from __future__ import annotations

import collections
import logging
import time
from itertools import accumulate, compress
from operator import attrgetter, itemgetter
from typing import Callable, Iterable, Iterator, Sequence

import numba
import numpy as np

from ..access import Caller
from ..codecs import encode_segment
from ..hostmem import host_address
from ..keys import ObjectKey
from ..segment import RawReason, parse_header
from ..tiers.dram import UNIT, units_of
from .api import ChunkBlocks, SaveResult
from .batching import RunCutter, _pipelined
from .device import _gather_batch, _gather_device, _gather_host, _Targets
from .registry import _BLOCKS, _Engine, _Seg
from .verify import _REP_NAMES

_CHUNK, _SEG, _KEY = itemgetter(0), itemgetter(1), itemgetter(2)  # of a save item (chunk, segment, key)
_KEY_OF = attrgetter("key")
_RAW_NAMES = {int(r): r.name.lower() for r in RawReason}

log = logging.getLogger("orbitkv_fs.manager")


class _SaveAcc:
    """A save request's admissions: the keys admitted one by one (``admitted``), the key lists the batches
    published (``batches``: each key newly published, so distinct within a list; kept as lists, no per-key set
    work on the usual path; :meth:`keys` joins them when a caller needs the set), and the request's counters."""

    __slots__ = ("admitted", "batches", "logical", "stored", "raw", "dropped", "present")

    def __init__(self) -> None:
        self.admitted: set[bytes] = set()
        self.batches: list[list[bytes]] = []
        self.logical = self.stored = self.dropped = self.present = 0
        self.raw: dict[str, int] = {}

    def admit(self, kb: bytes, logical: int, stored: int) -> None:
        self.admitted.add(kb)
        self.logical += logical
        self.stored += stored

    def admit_batch(self, keys: list[bytes]) -> None:
        """The keys a batch published (the publish answered True for each)."""
        self.batches.append(keys)

    def keys(self) -> set[bytes]:
        """Every key admitted so far, as a set."""
        for ks in self.batches:
            self.admitted.update(ks)
        self.batches.clear()
        return self.admitted


class SaveRows:
    """One codec batch of a save as columns: ``chunks``, the chunk runs it holds (a chunk once per run, in
    order), and per segment (row) ``ci``, its run's place in ``chunks``, ``si``, its segment's index in the
    registration (int64 arrays), and ``keys``, its packed key. ``starts``: the first row of each run, then
    the row count, when the runs' chunks are distinct (each run is then one run of a key prefix, as the
    index's key scan would find it), else None. Built per batch from the runs' slices (:meth:`join`); a
    per-segment path asks for :meth:`items`."""

    __slots__ = ("chunks", "ci", "si", "keys", "starts")

    def __init__(self, chunks: list[ChunkBlocks], ci: np.ndarray, si: np.ndarray, keys: list[bytes],
                 starts: "list[int] | None" = None) -> None:
        self.chunks, self.ci, self.si, self.keys, self.starts = chunks, ci, si, keys, starts

    @classmethod
    def join(cls, pieces: Sequence[tuple[tuple[ChunkBlocks, np.ndarray, list[bytes]], int, int]]) -> "SaveRows":
        """The rows of :meth:`~orbitkv_fs.manager.batching.Batching._run_batches`' pieces: ``(run, lo,
        hi)``, rows ``lo .. hi`` of a run ``(chunk, segment indices, keys)``."""
        keys: list[bytes] = []
        for (_, _, ks), lo, hi in pieces:
            keys += ks[lo:hi]
        si = np.concatenate([run[1][lo:hi] for run, lo, hi in pieces])
        sizes = [hi - lo for _, lo, hi in pieces]
        ci = np.repeat(np.arange(len(pieces)), sizes)
        chunks = [run[0] for run, _, _ in pieces]
        starts = list(accumulate(sizes, initial=0)) if len({ch.key for ch in chunks}) == len(chunks) else None
        return cls(chunks, ci, si, keys, starts)

    def __len__(self) -> int:
        return len(self.keys)

    def items(self, segs: Sequence[_Seg]) -> list[tuple[ChunkBlocks, _Seg, bytes]]:
        """``(chunk, segment, key)`` per row: what the per-segment paths take."""
        chunks = self.chunks
        return [(chunks[c], segs[s], k) for c, s, k in zip(self.ci.tolist(), self.si.tolist(), self.keys)]


class _SaveBatch:
    """One save batch between :meth:`Manager._save_submit` and :meth:`Manager._save_finish`."""

    __slots__ = ("rows", "srcs", "buffer", "ws", "regions", "direct", "engine", "job", "blobs", "seconds")

    def __init__(self, rows: SaveRows) -> None:
        self.rows = rows
        self.srcs: list = []  # gathered sources ...
        self.buffer = None  # ... and the device buffer behind the spans: alive until the GPU has read them
        self.ws = 0  # workspace bytes counted for it
        self.regions: list[tuple[int, int]] = []  # arena extents the GPU engine writes segments into
        self.direct: set[int] = set()  # batch indices written to the SSD from device memory
        self.engine = None  # the GPU codec engine ...
        self.job = None  # ... and its EncodeJob
        self.blobs: list = []  # host codecs: the segments
        self.seconds = 0.0


def _classes_of(eng: _Engine, make: Callable, uniq: np.ndarray) -> "list | None":
    """The encode classes of (segment index << 32 | blocks per chunk) values ``uniq``, each made once per
    registration (``make(segment, blocks)``); None when one is not a GPU encode (one the host codec decides).
    :meth:`SavePipeline._save_columns` keeps the answer per batch sequence of pairs (``_Engine.enc_rows``)."""
    known = eng.enc_classes
    if len(known) > 4096:
        known.clear()
    classes: list = []
    for u in uniq.tolist():
        pair = (u >> 32, u & 0xFFFFFFFF)
        t = known.get(pair)
        if t is None:
            t = known[pair] = make(eng.segs[pair[0]], pair[1])
        if t.kind not in ("raw", "fp8", "tq", "ans"):
            return None
        classes.append(t)
    return classes


class SavePlan:
    """What a save does with each segment of an engine's chunk of ``blocks`` blocks: ``raw[i]``, whether
    segment ``i`` (of ``segs``) takes the host path of exact segments; ``bound[i]`` and ``source[i]``, its
    coded bound and source bytes; for a whole chunk, the cumulative sums over its coded segments, in order
    (what :meth:`~orbitkv_fs.manager.batching.Batching._run_batches` cuts batches with), and the same of its
    host-path ones' source bytes (``cum_raw``: what the host path's batches are cut with); ``coded`` and
    ``exact``, the indices of the segments that do not and that do take the host path (``coded_si`` and
    ``exact_si``: as arrays)."""

    __slots__ = ("raw", "bound", "source", "cum_bound", "cum_source", "cum_raw", "coded", "coded_si", "exact",
                 "exact_si")

    def __init__(self, segs: Sequence[_Seg], blocks: int, raw_on_host: bool) -> None:
        self.raw = [seg.codec is None and raw_on_host for seg in segs]
        self.bound = [seg.coded_bound(blocks) for seg in segs]
        self.source = [blocks * seg.block_bytes for seg in segs]
        self.coded = [i for i, r in enumerate(self.raw) if not r]  # the segments the codecs take, in order
        self.coded_si = np.asarray(self.coded, dtype=np.int64)
        self.exact = [i for i, r in enumerate(self.raw) if r]
        self.exact_si = np.asarray(self.exact, dtype=np.int64)
        self.cum_bound = list(accumulate((self.bound[i] for i in self.coded), initial=0))
        self.cum_source = list(accumulate((self.source[i] for i in self.coded), initial=0))
        self.cum_raw = list(accumulate((self.source[i] for i in self.exact), initial=0))


def _gaps(regions: list[tuple[int, int]], off: np.ndarray, size: np.ndarray) -> list[tuple[int, int]]:
    """The parts of ``regions`` (a list of (offset, length)) not covered by the extents at ``off`` of ``size``
    bytes (arrays; the extents do not overlap one another); all unit-aligned. One
    compiled pass over the extents sorted, per region: a batch publishes hundreds of extents from one region."""
    if not regions:
        return []
    pos, n = np.array(regions, dtype=np.int64).reshape(-1, 2).T
    out = np.empty((len(regions) * (len(off) + 1), 2), dtype=np.int64)
    m = _gap_rows(np.ascontiguousarray(pos), np.ascontiguousarray(n), np.asarray(off, dtype=np.int64),
                  np.asarray(size, dtype=np.int64), out)
    return list(map(tuple, out[:m].tolist()))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _gap_rows(pos: np.ndarray, n: np.ndarray, off: np.ndarray, size: np.ndarray, out: np.ndarray) -> int:
    """:func:`_gaps` 's rows into ``out``; answers how many. The gaps of a region lie between its start, each
    extent's end and the next extent's start (an extent across the region's edge leaves an empty one there:
    the extents a..b-1 end after the region's start and start before its end)."""
    order = np.argsort(off, kind="mergesort")
    starts = off[order]
    ends = starts + size[order]
    m = 0
    for r in range(len(pos)):
        end = pos[r] + n[r]
        a = np.searchsorted(ends, pos[r], side="right")
        b = np.searchsorted(starts, end, side="left")
        lo = pos[r]
        for j in range(a, b):
            if starts[j] > lo:
                out[m, 0], out[m, 1] = lo, starts[j] - lo
                m += 1
            lo = ends[j]
        if end > lo:
            out[m, 0], out[m, 1] = lo, end - lo
            m += 1
    return m


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _job_rows(fmt: np.ndarray, addr: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`_segment_fields` 's pass over a GPU job's arrays: each segment's Format (int64), its arena offset
    (-1 where the job has no address) and how many the engine did not encode (Format -1)."""
    k = fmt.shape[0]
    f, off = np.empty(k, np.int64), np.empty(k, np.int64)
    others = 0
    for i in range(k):
        f[i] = fmt[i]
        others += fmt[i] < 0
        off[i] = addr[i] - base if addr[i] else -1
    return f, off, others


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _in_regions(off: np.ndarray, length: np.ndarray, pos: np.ndarray, n: np.ndarray,
                unit: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Which segments at ``off`` lie in one of the regions ``pos``/``n`` (a batch's arena regions: the GPU
    engine wrote them in place), each one's extent (its ``length`` in whole units) and how many lie there."""
    k = off.shape[0]
    placed, extent = np.empty(k, np.bool_), np.empty(k, np.int64)
    count = 0
    for i in range(k):
        o = off[i]
        inside = False
        for r in range(pos.shape[0]):
            if pos[r] <= o < pos[r] + n[r]:
                inside = True
                break
        placed[i] = inside
        count += inside
        extent[i] = -(-length[i] // unit) * unit
    return placed, extent, count


def _segment_fields(job, blobs: list, arena_base: int) -> tuple[np.ndarray, ...]:
    """Per segment of a finished save batch: Format, source bytes, segment bytes, RawReason and arena
    offset (-1 for one outside the arena: a host-encoded or fallback segment). From the GPU engine's job
    arrays where it has them; headers are parsed only for the segments it did not encode itself."""
    k = len(blobs)
    if job is not None:
        fmt, off, n_others = _job_rows(job.fmt, job.addr, arena_base)
        others = np.flatnonzero(fmt < 0).tolist() if n_others else []
        # the job's own arrays where every segment is the engine's (the usual batch): nothing below writes them
        original, length, reason = ((job.original.copy(), job.length.copy(), job.reason.astype(np.int64)) if others
                                    else (job.original, job.length, job.reason))
    else:
        fmt = np.full(k, -1, np.int64)
        original, length, reason, off = (np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64),
                                         np.full(k, -1, np.int64))
        others = range(k)
    for j in others:
        blob = blobs[j]
        h = parse_header(blob)
        fmt[j], original[j], length[j], reason[j] = int(h.format), h.original_length, len(blob), int(h.raw_reason)
        if type(blob) is memoryview and len(blob):
            off[j] = host_address(blob) - arena_base
    return fmt, original, length, reason, off


class SavePipeline:
    """The save pipeline."""

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, caller: Caller | None = None) -> SaveResult:
        """Gather each chunk's blocks per (layer, role) into segments, encode them in batches, admit them
        to DRAM (evicting, and demoting to the lower tier, as needed). Chunks already present are skipped.
        Raises :class:`RequestError` before doing anything when a block id or key is bad."""
        t0, c0 = time.perf_counter(), time.thread_time()
        eng = self._enter(engine_id, caller)
        try:
            self._check_chunks(eng, chunks)
            self._remember_prefix(eng, [ch.key for ch in chunks])
            todo: list[tuple[ChunkBlocks, list[bytes]]] = []
            acc = _SaveAcc()
            # A batch closes before its encoded bytes would pass the budget of its flights (two flights must
            # fit side by side in the GPU engine's workspace, or the next one waits for the previous one's
            # copies). Sized by encoded bytes, a compressing codec's batch carries more source, so the
            # per-batch host work is spread over more logical bytes.
            batches = map(SaveRows.join, self._run_batches(self._save_items(eng, chunks, todo, acc),
                                                           self._flights(eng)))
            self._save_batches(eng, batches, acc)
            present = acc.present
            segments = sum(len(ks) for _, ks in todo)
            chunk_keys = set(map(_KEY_OF, map(_CHUNK, todo)))
            # Chunks named once each: todo's keys are distinct, and so are the batches' published keys (each one
            # newly published), so their count is the number admitted, without a set of every key.
            if not acc.admitted and len(chunk_keys) == len(todo) and sum(map(len, acc.batches)) == segments:
                admitted_count, saved_chunks = segments, chunk_keys
            else:
                admitted = acc.keys()
                admitted_count = len(admitted)
                if admitted_count == segments:  # every segment admitted (todo's keys are distinct then)
                    saved_chunks = chunk_keys
                else:
                    saved_chunks = {ch.key for ch, ks in todo if not admitted.isdisjoint(ks)}
            dt = time.perf_counter() - t0
            self._cpu("save", time.thread_time() - c0, segments)
            self._add(save_requests=1, save_logical_bytes=acc.logical, save_stored_bytes=acc.stored, save_seconds=dt,
                      dropped_segments=acc.dropped)
            return SaveResult(chunks_saved=len(saved_chunks), chunks_present=present, segments=admitted_count,
                              logical_bytes=acc.logical, stored_bytes=acc.stored, raw_segments=acc.raw,
                              dropped_segments=acc.dropped, seconds=dt)
        finally:
            self._exit(eng)

    def _save_items(self, eng: _Engine, chunks: Sequence[ChunkBlocks], todo: list,
                    acc: "_SaveAcc") -> Iterator[tuple[tuple[ChunkBlocks, np.ndarray, list[bytes]], list[int], list[int]]]:
        """The segments of a save that go through the codecs, a chunk at a time, as runs for
        :meth:`_run_batches`: ``((chunk, segment indices, keys), cumulative coded bounds, cumulative source
        bytes)``, generated as the pipeline's batches ask for them (the first batch goes to the GPU before the
        later chunks are looked at). Every chunk with segments not cached yet is also appended to ``todo``
        with their keys; exact segments of host pages are saved here, straight into the arena, a batch at a
        time; ``acc.present`` counts the chunks present in full already. A chunk's keys and sizes come from
        its engine's :class:`SavePlan`."""
        segs, nseg = eng.segs, len(eng.segs)
        # GPU pages: exact segments go through the GPU engine too (one gather, CRC32C on the GPU, one
        # device-to-host copy into the arena per batch) rather than a host copy per block.
        raw_on_host = self._gpu_codecs is None or eng.info.device == "host"
        self._check_exact_bound(eng, chunks, raw_on_host)
        # ... and exact segments of host pages go straight into the arena, in batches of runs of a chunk's
        # segments as the codec batches are (_save_raw_batch), cut as the runs come.
        cap, budget = self._raw_batch_cap()
        cut = RunCutter(cap, budget, budget)
        plans, ns, tails = eng.save_plans, eng.ns, eng.tails
        for ch in chunks:
            prefix = ns + ch.key
            have = self.dram.chunk_count(prefix)
            if have >= nseg:
                acc.present += 1
                continue
            plan = plans.get((len(ch.blocks), raw_on_host))
            if plan is None:
                plan = plans[(len(ch.blocks), raw_on_host)] = SavePlan(segs, len(ch.blocks), raw_on_host)
            keys = list(map(prefix.__add__, tails))
            if have:  # partly cached: the segments it lacks, one lock round (none cached: no test at all)
                picked = list(compress(range(nseg), [not c for c in self.dram.contains_many(keys)]))
                todo.append((ch, [keys[i] for i in picked]))
                exact = [i for i in picked if plan.raw[i]]
                coded = [i for i in picked if not plan.raw[i]]
                si = np.asarray(coded, dtype=np.int64)
                cn = list(accumulate((plan.bound[i] for i in coded), initial=0))
                cm = list(accumulate((plan.source[i] for i in coded), initial=0))
                if exact:
                    raw_run = (ch, np.asarray(exact, dtype=np.int64), [keys[i] for i in exact])
                    raw_cum = list(accumulate((plan.source[i] for i in exact), initial=0))
            else:
                todo.append((ch, keys))
                coded, si, cn, cm = plan.coded, plan.coded_si, plan.cum_bound, plan.cum_source
                exact = plan.exact
                if exact:
                    raw_run = (ch, plan.exact_si, keys if len(exact) == nseg else [keys[i] for i in exact])
                    raw_cum = plan.cum_raw
            if exact:
                for batch in cut.push(raw_run, raw_cum, raw_cum):
                    self._save_raw_batch(eng, SaveRows.join(batch), acc)
            if coded:
                yield (ch, si, keys if len(coded) == nseg else [keys[i] for i in coded]), cn, cm
        if cut.batch:
            self._save_raw_batch(eng, SaveRows.join(cut.batch), acc)

    def _save_batches(self, eng: _Engine, batches: Iterable[SaveRows], acc: "_SaveAcc") -> None:
        """Encode and admit ``batches`` (of :meth:`_save_items`) in order, pipelined: batch i+1 is formed,
        gathered and queued on the GPU before the host waits for batch i and publishes its segments."""
        _pipelined(batches, lambda b: self._save_submit(eng, b), lambda sb: self._save_finish(eng, sb, acc))

    def _save_submit(self, eng: _Engine, rows: SaveRows) -> "_SaveBatch":
        """Gather and encode one batch: queued on the GPU engine (finished by :meth:`_save_finish`), or
        done here with the host codecs. Sources of GPU pages whose codecs the engine runs go to it as arrays
        (:meth:`_save_columns`: sources, classes), the others as one item per segment."""
        c0 = time.thread_time()
        gpu = self._gpu_codecs
        on_device = gpu is not None and eng.info.device != "host"
        sb = _SaveBatch(rows)
        if gpu is not None:
            sb.engine = engine = gpu.engine(eng.reg.rotation_seed)
        sink, sb.direct = self._ssd_direct_sink(eng, rows)
        cols = self._save_columns(eng, engine, rows) if on_device and sink is None and self.dram.arena.pinned else None
        batch: list[tuple[ChunkBlocks, _Seg, bytes]] = []
        if cols is not None:
            targets, classes, cls, ci, si = cols
            ptrs, sb.buffer = gpu.gather_rows(engine, targets, ci, si)
            sb.ws = int((targets.counts[ci] * targets.block_bytes[si]).sum())
        else:
            batch = rows.items(eng.segs)
            if on_device:
                sb.srcs, sb.buffer = _gather_batch([(seg, ch.blocks) for ch, seg, _ in batch],
                                                   lambda n: engine.block_buffer(n, restore=False), engine.gather_blocks)
            else:
                sb.srcs = [_gather_device(seg, ch.blocks) if gpu else _gather_host(seg, ch.blocks)
                           for ch, seg, _ in batch]
            sb.ws = sum(x.nbytes for x in sb.srcs)
        self._workspace_delta(sb.ws)

        def arena_region(nbytes: int) -> np.ndarray | None:
            off = self.dram.reserve(nbytes)
            if off is None:
                return None
            sb.regions.append((off, units_of(nbytes) * UNIT))
            return self.dram.view(off, nbytes)

        t0 = time.perf_counter()
        try:
            if cols is not None:
                sb.job = engine.encode_columns_submit(classes, cls, ptrs, out_region=arena_region, slot_align=UNIT)
                if sb.job is None:  # a segment needs more than half the engine's workspace: one item each
                    sb.srcs = gpu.items_of(ptrs, targets, ci, si, eng.segs)
                    sb.job = engine.encode_submit(sb.srcs, out_region=arena_region, slot_align=UNIT)
            elif gpu is not None:
                sb.job = engine.encode_submit(
                    [gpu.item(x, seg) for x, (_, seg, _) in zip(sb.srcs, batch)],
                    out_region=arena_region if self.dram.arena.pinned else None, slot_align=UNIT, device_sink=sink)
            else:
                sb.blobs = [encode_segment(x, seg.codec, role=seg.role, layer=seg.layer)
                            for x, (_, seg, _) in zip(sb.srcs, batch)]
        except BaseException:
            self._save_abort(sb)
            raise
        sb.seconds = time.perf_counter() - t0
        self._cpu("save_encode", time.thread_time() - c0, len(rows))
        return sb

    def _save_columns(self, eng: _Engine, engine, rows: SaveRows) -> "tuple | None":
        """A batch of GPU pages for the engine's ``encode_columns_submit``: the chunks' targets, the encode
        classes met (one per segment and chunk size, made once per engine registration), and per segment its
        class, chunk and segment index. None when a class is not a GPU encode (the host codec decides it), or
        the pages are not regular rows (the batch then goes as items)."""
        if eng.geometry is None:
            return None
        ci, si = rows.ci, rows.si
        blocks = np.fromiter(map(len, map(_BLOCKS, rows.chunks)), dtype=np.int64, count=len(rows.chunks))
        pairs = (si << 32) | blocks[ci]
        key = pairs.tobytes()
        got = eng.enc_rows.get(key)  # a save's batches of whole chunks repeat one sequence of pairs
        if got is None:
            uniq, cls = np.unique(pairs, return_inverse=True)
            gpu = self._gpu_codecs
            got = (_classes_of(eng, lambda seg, blocks: gpu.encode_class(engine, seg, blocks), uniq), cls.reshape(-1))
            got[1].flags.writeable = False
            if len(eng.enc_rows) >= 64:
                eng.enc_rows.clear()
            eng.enc_rows[key] = got
        classes, cls = got
        if classes is None:
            return None
        return _Targets(rows.chunks, eng.segs, eng.geometry), classes, cls, ci, si

    def _save_abort(self, sb: "_SaveBatch") -> None:
        """A batch that will not be published: its GPU work ends, its arena extents and workspace go back."""
        try:
            if sb.job is not None:
                sb.engine.encode_collect(sb.job)
        except Exception:  # already failing: the first error is the one reported
            pass
        finally:
            for off, n in sb.regions:
                self.dram.cancel(off, n)
            sb.regions.clear()
            self._workspace_delta(-sb.ws)
            sb.ws = 0
            sb.srcs, sb.buffer = [], None

    def _save_finish(self, eng: _Engine, sb: "_SaveBatch", acc: "_SaveAcc") -> None:
        """Wait for a submitted batch and admit its segments to DRAM (or hand them to the lower tier)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            blobs = sb.blobs if sb.job is None else sb.engine.encode_collect(sb.job)
        except BaseException:
            sb.job = None
            self._save_abort(sb)
            raise
        self._add(encode_seconds=sb.seconds + time.perf_counter() - t0, codec_batches=1,
                  ssd_direct_writes=len(sb.direct))
        self._workspace_delta(-sb.ws)
        sb.ws = 0
        sb.srcs, sb.buffer = [], None
        regions = sb.regions
        fmt, original, length, reason, off = _segment_fields(sb.job, blobs, self.dram.arena.base_address)
        # In place: segments the engine wrote into this batch's arena regions, published where they lie.
        pos, span = np.array(regions, dtype=np.int64).reshape(-1, 2).T
        placed, extent, count = _in_regions(off, length, pos, span, UNIT)
        used_off = used_len = np.zeros(0, np.int64)  # arena extents of the batch's regions, published in place
        published = False
        try:
            self._check_pages(eng)  # host pages that shrank under the gather: zeros were encoded, not the engine's KV
            all_keys = sb.rows.keys
            whole = count == len(blobs)  # every segment in place (the usual batch): no per-key selection
            if whole:
                keys, used_off, used_len, stored, logical, formats = all_keys, off, extent, length, original, fmt
            else:
                for j in np.flatnonzero(~placed).tolist():  # host fallbacks: a reservation and a copy each
                    self._admit_copy(all_keys[j], blobs[j], int(original[j]), int(fmt[j]), acc)
                at = np.flatnonzero(placed)
                keys = [all_keys[j] for j in at.tolist()]
                used_off, used_len, stored, logical, formats = off[at], extent[at], length[at], original[at], fmt[at]
            # Set first: should publish_many fail part way, an extent it published must not go back to the pool.
            published = True
            # keys made here from checked chunk keys and the registration's tails: their scan is known
            runs = (eng.subs[sb.rows.si], sb.rows.starts) if whole and sb.rows.starts is not None else None
            done = self.dram.publish_many(keys, used_off, stored, logical, formats, runs=runs)  # one lock round
            if False in done:
                ok = np.fromiter(done, dtype=bool, count=len(done))
                acc.admit_batch(list(compress(keys, done)))
                acc.logical += int(logical[ok].sum())
                acc.stored += int(stored[ok].sum())
            else:
                acc.admit_batch(keys)
                acc.logical += int(logical.sum())
                acc.stored += int(stored.sum())
        finally:  # slot padding, batch metadata, fallback slots, what an error left unpublished: back to the pool
            if not published:  # nothing of the regions was published
                used_off = used_len = np.zeros(0, np.int64)
            for o, n in _gaps(regions, used_off, used_len):
                self.dram.cancel(o, n)
            regions.clear()
        reps = np.bincount(fmt, minlength=len(_REP_NAMES)).tolist()
        raws = {}
        if reason.any():  # raw segments with a reason (the policy's exact layers, fallbacks): counted by it
            counts = np.bincount(reason).tolist()
            raws = {_RAW_NAMES[c]: n for c, n in enumerate(counts) if n and c}
        with self._stat_lock:  # one lock round per batch, not two per segment
            for f, n in enumerate(reps):
                if n:
                    name = _REP_NAMES[f]
                    self._codec_segments[name] = self._codec_segments.get(name, 0) + n
            for name, n in raws.items():
                self._raw[name] = self._raw.get(name, 0) + n
        for name, n in raws.items():
            acc.raw[name] = acc.raw.get(name, 0) + n
        self._cpu("save_publish", time.thread_time() - c0, len(sb.rows))

    def _admit_copy(self, kb: bytes, blob, logical: int, fmt: int, acc: "_SaveAcc") -> None:
        """Admit a segment that lies outside the arena (a host fallback): into an extent of its own,
        published at once (the next reservation may have to evict it: a pool smaller than a batch), or to
        the lower tier when DRAM is full of leased objects."""
        n = len(blob)
        off = self.dram.reserve(n)
        if off is None:
            self._demote_direct(kb, blob, acc)
            return
        try:
            self.dram.view(off, n)[:] = np.frombuffer(blob, dtype=np.uint8)
        except BaseException:
            self.dram.cancel(off, n)
            raise
        if self.dram.publish(kb, off, n, logical, fmt) is not None:
            acc.admit(kb, logical, n)

    def _ssd_direct(self, eng: _Engine) -> bool:
        """The cuFile direct path applies: GPU pages, the GPU codec engine, and a lower tier that moves
        device memory itself (an SSD tier on the cuFile backend)."""
        return (self._gpu_codecs is not None and eng.info.device != "host"
                and bool(getattr(self.lower, "device_io", False)))

    def _ssd_direct_sink(self, eng: _Engine, rows: SaveRows):
        """For :meth:`_save_submit`: a ``device_sink`` for the GPU engine that writes the complete state
        groups of ``rows`` (chunks whose every (layer, role) segment is in this batch) from device
        memory straight to the SSD tier (``submit_device``), and the set it fills with the batch indices
        written that way; (None, empty set) when the direct path does not apply. Fragmented groups (a
        chunk split over batches, or partly cached already) and segments the engine coded on the host
        are not written here: DRAM demotes them through the tier's io_uring-style writeback as before.
        A dropped or failed direct write is left to that writeback too. DRAM admits every segment as usual."""
        written: set[int] = set()
        if not self._ssd_direct(eng):
            return None, written
        count: collections.Counter = collections.Counter()
        for ch, n in zip(rows.chunks, np.bincount(rows.ci, minlength=len(rows.chunks)).tolist()):
            count[ch.key] += n  # by key: a chunk named twice in a batch is not one state group
        nseg = len(eng.segs)
        whole = np.fromiter((count[ch.key] == nseg for ch in rows.chunks), dtype=bool, count=len(rows.chunks))
        complete = set(np.flatnonzero(whole[rows.ci]).tolist())
        if not complete:
            return None, written
        lower, keys = self.lower, rows.keys

        def sink(i: int, segment) -> None:
            if i not in complete:
                return
            try:
                if lower.submit_device(ObjectKey.unpack(keys[i]), segment):
                    written.add(i)
            except Exception as e:  # the writeback path still has the segment: never fail the save
                log.warning("direct SSD write of %s failed: %s", ObjectKey.unpack(keys[i]), e)

        return sink, written

    def _demote_direct(self, kb: bytes, blob: bytes, acc: "_SaveAcc") -> None:
        """DRAM is full of leased objects: hand the segment to the lower tier, or drop it."""
        if self.lower is not None and self.lower.submit(ObjectKey.unpack(kb), bytes(blob)):
            acc.admit(kb, parse_header(blob).original_length, len(blob))
        else:
            acc.dropped += 1
