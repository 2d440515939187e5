"""The restore pipeline: leased or fetched segments -> verified -> decoded into the engine's blocks.

Primitives: :meth:`RestorePipeline.restore`, :meth:`~RestorePipeline._acquire` (sources: DRAM under a
lease, else the lower tier, else peers), :meth:`~RestorePipeline._decode_gpu` with
:meth:`~RestorePipeline._decode_start` / :meth:`~RestorePipeline._decode_end` (GPU batches, pipelined),
:meth:`~RestorePipeline._decode_gpu_rows` (the same for a restore given as arrays, :class:`_Rows`: every
segment a DRAM extent, no Python per segment), :meth:`~RestorePipeline._start_early` /
:meth:`~RestorePipeline._abort_early` (its first batches started, part by part, before the rest of the request
is leased and checked),
:meth:`~RestorePipeline._restore_ssd_device` (the cuFile direct path), :meth:`~RestorePipeline._upload_raw`
(raw segments into GPU blocks), :meth:`~RestorePipeline._write` (one segment into host blocks).

Invariants: every destination is validated before anything is written (the early first batches decode into
their temporaries only, scattered after the rest's checks); no segment is written without a
valid header and CRC32C (a bad one is a miss for its chunk, never an exception); the restore's hold and the
lookup lease it consumes are dropped however it ends.
"""

from __future__ import annotations

import logging
import time
from itertools import chain, compress
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import msgspec
import numpy as np

from ..access import Caller
from ..codecs import decode_payload
from ..errors import SegmentError
from ..hostmem import host_address
from ..keys import ObjectKey, segment_keys
from ..pages import cupy_dtype
from ..segment import HEADER_DTYPE, HEADER_SIZE, Format, SegmentHeader, peek_source
from .api import ChunkBlocks, LeaseError, Miss, RequestError, RestoreResult
from .batching import ALIGN_SHARE, EARLY_BATCHES, _decode_bound, _pipelined
from .device import _Targets
from .leases import Spans, _Lease
from .lower import _lower_contains
from .registry import _Engine, _Seg
from .verify import _verify, _verify_header, _verify_headers, header_of, read_sizes

log = logging.getLogger("orbitkv_fs.manager")


class _Sizes(msgspec.Struct, frozen=True):
    """The sizes of a segment decoded on the direct path (its header stayed on the device)."""

    original_length: int
    stored_length: int


class _Rows(NamedTuple):
    """A restore whose every segment is a DRAM extent bound for the GPU engine, its size fields checked in
    phase 1 (:meth:`RestorePipeline._check_device_batch`), as arrays over rows, chunk-major (row ``r``: chunk
    ``r // len(segs)``, segment ``r % len(segs)``)."""

    chunks: Sequence[ChunkBlocks]
    segs: Sequence[_Seg]
    keys: list[list[bytes]]
    heads: np.ndarray  # [n, 64] header rows
    sizes: np.ndarray  # [n, 5]: batch bytes, decoded, stored, extent length, arena offset
    layers: np.ndarray  # what each row's key names
    roles: np.ndarray
    formats: np.ndarray  # each header's format field (as it stands: verified batch by batch)

    @classmethod
    def of(cls, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], keys: list[list[bytes]], heads: np.ndarray,
           sizes: np.ndarray) -> "_Rows":
        layers = np.fromiter((s.layer for s in segs), dtype=np.int64, count=len(segs))
        roles = np.fromiter((int(s.role) for s in segs), dtype=np.int64, count=len(segs))
        return cls(chunks, segs, keys, heads, sizes, np.tile(layers, len(chunks)), np.tile(roles, len(chunks)),
                   heads.view(HEADER_DTYPE).reshape(-1)["format"])


class _Early(NamedTuple):
    """One of a restore's first decode batches, started before the rest of the request was leased and checked
    (:meth:`RestorePipeline._start_early`): the request's destinations, the end of its rows and what
    :meth:`RestorePipeline._rows_submit` answered for them."""

    targets: "_Targets"
    end: int
    started: tuple


def _row_headers(rows: _Rows, at: np.ndarray, tid: np.ndarray, templates: list[SegmentHeader]) -> list[SegmentHeader]:
    """The headers of verified rows ``at`` (:meth:`RestorePipeline._verified_rows`): each one's template (by
    ``tid``) with the row's own payload CRC and stored length (:func:`~.verify.header_of`)."""
    return [header_of(templates[t], row) for t, row in zip(tid.tolist(), rows.heads[at].view(HEADER_DTYPE).reshape(-1))]


def _key_runs(subs: np.ndarray, chunks: int) -> tuple[np.ndarray, list[int]]:
    """The index's scan (:meth:`~orbitkv_fs.index.ObjectIndex.get_many` 's ``runs``) of the segment keys of
    ``chunks`` chunks as :func:`~orbitkv_fs.keys.segment_keys` makes them from tails whose subs are ``subs``,
    chunk after chunk: each key's sub, one run per chunk."""
    nseg = len(subs)
    return np.tile(subs, chunks), list(range(0, chunks * nseg + 1, nseg))


def _misses(keys: list[list[bytes]], sources: dict, spans: Spans | None, served: "set[bytes] | dict") -> int:
    """The keys of a restore that no source served: not leased from DRAM (``spans``), not in ``sources``
    (lower tier, peers, views), not ``served`` by the direct SSD path."""
    if spans is not None and spans.hit.all() and len(spans.hit) == sum(map(len, keys)):
        return 0
    found = spans if spans is not None else {}
    return sum(1 for ks in keys for k in ks if k not in sources and k not in found and k not in served)


class RestorePipeline:
    """The restore pipeline."""

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0,
                layers: Sequence[int] | None = None, caller: Caller | None = None) -> RestoreResult:
        """Write the chunks' cached KV into the given blocks. Every destination is validated first
        (:class:`RequestError`, nothing written); a missing or corrupt segment is a miss for its chunk.
        ``lease_id`` (from :meth:`lookup`, of this engine) is released when the restore ends, whether it
        succeeded or failed. ``layers`` restores only those layers' segments (an engine loading layer by
        layer); ``restored[i]`` then says whether every segment of those layers was written."""
        t0, c0 = time.perf_counter(), time.thread_time()
        eng = self._enter(engine_id, caller)
        held = _Lease(engine_id)
        consume = 0  # the lookup lease this restore ends, once it is known to be this engine's
        earlies: list[_Early] = []  # first batches started before the rest was checked (_start_early)
        try:
            if lease_id:
                with self._lock:
                    lease = self._leases.get(lease_id)
                    late = lease is None and self._expired.get(lease_id, 0) == engine_id
                if late:  # its lease ended: the restore takes its own hold below; evicted chunks miss
                    log.warning("engine %r restores under lease %d, which ended (expired, or displaced by its "
                                "newer leases)", engine_id, lease_id)
                elif lease is None or lease.engine_id != engine_id:
                    raise LeaseError(f"lease {lease_id} is not held by engine {engine_id!r}")
                else:
                    consume = lease_id
            self._check_chunks(eng, chunks, skips=True)
            segs = eng.segs
            if layers is not None:
                wanted = set(layers)
                if not wanted or not wanted <= {s.layer for s in eng.segs}:
                    raise RequestError(f"layers: {sorted(wanted)} are not all layers of engine {engine_id!r} "
                                       f"[{eng.info.layer_start}, {eng.info.layer_end})")
                picked = [s.layer in wanted for s in eng.segs]
                segs = list(compress(eng.segs, picked))
                tails = list(compress(eng.tails, picked))
                subs = eng.subs[np.asarray(picked, dtype=bool)]
            else:
                tails, subs = eng.tails, eng.subs
            # A layer-by-layer load makes one call per layer: read ahead once, on the first layer's call.
            first = layers is None or eng.segs[0].layer in wanted
            reasons: dict[bytes, str] = {}
            pf_hits = self.dram.prefetch_hits  # a heuristic trigger: other requests may move it too
            tally = {"lower": 0}
            fresh: set[bytes] = set()  # keys whose source bytes were just validated in full (private copies)
            # SSD keys read into device memory and decoded there (the cuFile direct path), not sourced here.
            device: set[bytes] | None = set() if self._ssd_direct(eng) else None
            nkeys = len(chunks) * len(segs)
            on_device = eng.info.device != "host"
            gpu = self._gpu_codecs
            gpu_checks = gpu is not None and on_device
            # The DRAM extents' places, for the batch checks: of exact segments of host pages
            # (_check_host_batch), of the headers of segments bound for the GPU engine (_check_device_batch).
            spans = None if on_device and not gpu_checks else Spans()
            c1 = time.thread_time()
            # The first codec batches' chunks keyed, leased and checked first, part by part, and each part's batch
            # started, so that the GPU copies them while the host does the same for the next part and the rest
            # (else the GPU idles through all of that): two, the pipeline's depth.
            parts = self._early_heads(chunks, segs) if gpu_checks and spans is not None and device is None else []
            head = parts[-1] if parts else 0
            keys = [segment_keys(eng.ns, ch.key, tails) for ch in (chunks[:parts[0]] if parts else chunks)]
            kbs = [k for ks in keys for k in ks]
            head_checked = None
            if parts:
                sources: dict = {}
                started_cpu = 0.0  # the early starts' time, counted as phase 1's
                for i, (a, b) in enumerate(zip([0] + parts, parts)):
                    if a:
                        keys += [segment_keys(eng.ns, ch.key, tails) for ch in chunks[a:b]]
                    part = Spans()
                    sources.update(self._acquire([k for ks in keys[a:] for k in ks], held, reasons, tally, fresh,
                                                 None, part, _key_runs(subs, b - a)))
                    spans = part if not a else spans.joined(part)
                    got = self._check_device_batch(chunks[a:b], segs, keys[a:], part)
                    head_checked = got if not a else tuple(np.concatenate(x) for x in zip(head_checked, got))
                    if len(earlies) == i:  # every earlier part's batch started
                        t = time.thread_time()
                        e = self._start_early(eng, chunks, segs, keys, b, head_checked, earlies)
                        if e is not None:
                            earlies.append(e)
                        started_cpu += time.thread_time() - t
                keys = keys + [segment_keys(eng.ns, ch.key, tails) for ch in chunks[head:]]
                rest_kbs = [k for ks in keys[head:] for k in ks]
                rest = Spans()
                sources.update(self._acquire(rest_kbs, held, reasons, tally, fresh, None, rest,
                                             _key_runs(subs, len(chunks) - head)))
                spans = spans.joined(rest)
                c2 = time.thread_time()
                self._cpu("restore_acquire", c2 - c1 - started_cpu, nkeys)
                c2 -= started_cpu
            else:
                sources = self._acquire(kbs, held, reasons, tally, fresh, device, spans, _key_runs(subs, len(keys)))
                c2 = time.thread_time()
                self._cpu("restore_acquire", c2 - c1, nkeys)
            if first and chunks and (tally["lower"] or self.dram.prefetch_hits != pf_hits):
                self._readahead(eng, chunks[-1].key, {ch.key for ch in chunks})
            # Phase 1: check every source against its destination; write nothing yet. Segments bound for
            # GPU pages through the GPU engine get their payload CRC32C checked there, before anything is
            # written to their destination (a mismatch is a miss, as here). Their headers are verified in
            # full batch by batch while the GPU works on the previous batch (_decode_gpu): where the
            # segments are large the GPU is the bottleneck, and a check here would add to it. Here only
            # their size fields are read (for DRAM extents as one array, _check_device_batch), so that a
            # request its blocks cannot hold still fails before anything is written; a header whose fields
            # disagree is verified at once, to tell corruption (a miss) from a wrong request (RequestError).
            bad: dict[int, str] = {}
            plan: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, memoryview]] = []  # whole segments
            # headers checked later (None), batch by batch
            deferred: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader | None, memoryview, bytes]] = []
            from_ssd: list[tuple[int, _Seg, ChunkBlocks, bytes]] = []
            # Exact segments of host pages in DRAM: checked as one batch; the other chunks segment by segment.
            checked = self._check_host_batch(chunks, segs, keys, spans) if spans and not on_device else None
            batched = set(checked.chunks) if checked is not None else set()
            # Segments bound for the GPU engine from DRAM: size fields checked as one array (False: per segment).
            if head_checked is not None:  # the head's were checked with its lease: the rest's now
                tail = self._check_device_batch(chunks[head:], segs, keys[head:], rest)
                pre, heads, sizes = (np.concatenate((a, b)) for a, b in zip(head_checked, tail))
            elif gpu_checks and spans:
                pre, heads, sizes = self._check_device_batch(chunks, segs, keys, spans)
            else:
                pre = heads = sizes = None
            # Every segment a DRAM extent bound for the GPU engine, its size fields fitting: the restore is
            # decoded as arrays, batch by batch (_decode_gpu_rows), with no item per segment.
            rows = (_Rows.of(chunks, segs, keys, heads, sizes)
                    if pre is not None and len(pre) and pre.all() else None)
            if rows is None and earlies:  # the rest is not all rows: the usual paths take the head too
                self._abort_early(earlies)
                earlies = []
            arena_ids: set[int] = set()  # ids of the sources that are arena views (pinned where the arena is)
            nseg = len(segs)
            for ci, (ch, ks) in (() if rows is not None else enumerate(zip(chunks, keys))):
                if ci in batched:
                    continue
                for si, (seg, kb) in enumerate(zip(segs, ks)):
                    if pre is not None and pre[ci * nseg + si]:
                        src = memoryview(self.dram.view(*spans[kb]))
                        arena_ids.add(id(src))
                        deferred.append((ci, seg, ch, None, src, kb))
                        continue
                    src = sources.get(kb)
                    if src is None and spans:
                        span = spans.get(kb)
                        src = memoryview(self.dram.view(*span)) if span is not None else None
                    if src is None and device and kb in device:
                        from_ssd.append((ci, seg, ch, kb))
                        continue
                    if src is None:
                        bad.setdefault(ci, reasons.get(kb, "missing"))
                        continue
                    want = len(ch.blocks) * seg.block_bytes
                    if gpu_checks and peek_source(src) == (seg.dtype_code, want):
                        deferred.append((ci, seg, ch, None, memoryview(src), kb))
                        continue
                    try:
                        # Arena extents (shared memory) are checked in full; lower-tier bytes were
                        # validated by the tier a moment ago and need no second payload CRC pass.
                        h = _verify_header(kb, src) if kb in fresh or gpu_checks else _verify(kb, src)
                    except SegmentError as e:
                        self._add(decode_failures=1)
                        bad[ci] = f"corrupt: {type(e).__name__}: {e}"
                        continue
                    if h.original_length != want or h.dtype != seg.dtype:
                        raise RequestError(
                            f"chunks[{ci}]: layer {seg.layer} {seg.role.name.lower()} holds {h.original_length} "
                            f"bytes of {h.dtype}, the {len(ch.blocks)} destination blocks take {want} bytes of "
                            f"{seg.dtype}")
                    plan.append((ci, seg, ch, h, memoryview(src)))
            c3 = time.thread_time()
            self._cpu("restore_verify", c3 - c2, nkeys)
            # Phase 2: decode and scatter. With the GPU codec engine, coded segments go through it in
            # batches, and raw segments bound for GPU blocks in one upload per batch; the rest segment by
            # segment on the host.
            # The direct path's chunks first: one whose SSD record fails is marked bad before any other
            # segment of it is written.
            done_ssd, served_ssd = self._restore_ssd_device(eng, from_ssd, bad, reasons)
            segments, logical = self._write_host_batch(chunks, segs, checked, bad) if batched else (0, 0)
            stored = logical + HEADER_SIZE * segments
            coded: list[tuple[int, _Seg, ChunkBlocks, "SegmentHeader | None", memoryview, bytes]] = deferred
            raw_dev: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, memoryview]] = []
            done: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, Exception | None]] = done_ssd
            for item in plan:
                ci, seg, ch, h, blob = item
                if ci in bad:
                    continue
                if gpu is not None and (h.format != Format.RAW or on_device):
                    coded.append(item + (b"",))
                elif on_device and h.format == Format.RAW:
                    raw_dev.append(item)
                else:
                    try:
                        self._write(seg, ch.blocks, h, blob)
                        done.append((ci, seg, ch, h, None))
                    except Exception as e:  # a codec failure on a checksummed segment: a miss, not a crash
                        done.append((ci, seg, ch, h, e))
            gpu_totals = (0, 0, 0)
            if rows is not None:
                taken, earlies = earlies, []  # ended by the pipeline from here on, however it ends
                failed, gpu_totals = self._decode_gpu_rows(eng, rows, bad, taken)
                done += failed
            elif coded:
                failed, gpu_totals = self._decode_gpu(eng, coded, bad, arena_ids)
                done += failed
            uploads: list = []  # pinned staging of raw uploads, freed once the stream is synchronised
            if raw_dev:
                done += self._upload_raw(raw_dev, uploads)
            if on_device:
                # Every copy into engine blocks was queued on this thread's CUDA stream: they must have
                # landed before the answer lets the engine read its pages.
                import cupy

                w0 = time.perf_counter()
                cupy.cuda.get_current_stream().synchronize()
                self._add(restore_gpu_wait_seconds=time.perf_counter() - w0)
                del uploads
            self._cpu("restore_write", time.thread_time() - c3, nkeys)
            segments += gpu_totals[0]
            logical += gpu_totals[1]
            stored += gpu_totals[2]
            for ci, seg, ch, h, err in done:
                if err is not None:
                    log.warning("decode failed for chunk %s layer %d: %s", ch.key.hex(), seg.layer, err)
                    self._add(decode_failures=1)
                    bad.setdefault(ci, f"decode: {type(err).__name__}: {err}")
                    continue
                segments += 1
                logical += h.original_length
                stored += HEADER_SIZE + h.stored_length
            misses = [Miss(chunks[i].key, r) for i, r in sorted(bad.items())]
            self._add(misses=_misses(keys, sources, spans, served_ssd))
            dt = time.perf_counter() - t0
            self._cpu("restore", time.thread_time() - c0, nkeys)
            self._add(restore_requests=1, restore_logical_bytes=logical, restore_stored_bytes=stored,
                      restore_seconds=dt)
            self._check_pages(eng)  # pages that shrank under the writes: what went past their end is lost
            return RestoreResult(restored=[i not in bad for i in range(len(chunks))], misses=misses,
                                 segments=segments, logical_bytes=logical, stored_bytes=stored, seconds=dt)
        except BaseException:
            if earlies:  # they read extents of the hold dropped below: ended first, nothing written
                self._abort_early(earlies)
            raise
        finally:
            self._drop_lease(held)
            if consume:
                with self._lock:
                    lease = self._leases.pop(consume, None)
                    self._forget_lease(eng, consume)
                if lease is not None:
                    self._drop_lease(lease)
            self._exit(eng)

    def _acquire(self, kbs: list[bytes], held: _Lease, reasons: dict[bytes, str],
                 tally: dict[str, int] | None = None,
                 fresh: set[bytes] | None = None,
                 device: set[bytes] | None = None,
                 spans: Spans | None = None,
                 runs: "tuple[np.ndarray, list[int]] | None" = None) -> dict[bytes, "memoryview | bytes"]:
        """Sources of ``kbs``: leased DRAM extents (recorded in ``held``), else verified lower-tier or peer
        bytes (readmitted to DRAM when they fit). Absent keys are left out; for keys whose bytes were bad,
        ``reasons`` says why. ``tally["lower"]`` counts the segments the lower tier served; ``fresh`` gets
        the keys whose bytes the lower tier validated in full (every CRC). With ``device`` (the cuFile
        direct path), keys DRAM lacks and the lower tier holds are not read here but put in ``device``
        (counted in ``tally["lower"]``): the caller reads them into device memory itself. With ``spans``,
        the DRAM extents leased are not in the answer: ``spans`` gets their arena extents (``kbs`` in order).
        ``runs``: the scan of ``kbs`` (:func:`_key_runs`)."""
        out: dict[bytes, memoryview | bytes] = {}
        missing = self._lease_dram(kbs, held, out, spans, runs)
        self._count(self._hits, "dram", len(kbs) - len(missing))
        if missing and device is not None and self.lower is not None:
            device.update(compress(missing, _lower_contains(self.lower, [ObjectKey.unpack(kb) for kb in missing])))
            missing = [kb for kb in missing if kb not in device]
            if tally is not None:
                tally["lower"] += len(device)
        if missing and self.lower is not None:
            still = []
            okeys = [ObjectKey.unpack(k) for k in missing]
            claimed = _lower_contains(self.lower, okeys)
            reads = self.lower.read_many(okeys)
            for kb, got, held_there in zip(missing, reads, claimed):
                blob = self._checked_lower(kb, got, reasons)
                if blob is None:
                    if held_there and kb not in reasons:  # the tier dropped it as corrupt, or its read failed
                        reasons[kb] = "lower tier: record failed validation or could not be read"
                    still.append(kb)
                    continue
                self._admit(kb, blob)
                out[kb] = blob
                if tally is not None:
                    tally["lower"] += 1
                if fresh is not None:
                    fresh.add(kb)
            missing = still
        fetch_into = getattr(self.peers, "fetch_into", None)
        if missing and fetch_into is not None:
            # Zero-copy: the fetcher reserves arena extents, reads into them and publish() verifies in
            # place; what landed is then leased and served like any DRAM hit.
            try:
                fetch_into(self, [ObjectKey.unpack(k) for k in missing])
            except Exception as e:  # peers failing is a miss
                log.warning("peer fetch failed: %s", e)
            # Not delivered, failed verification, or already evicted again: still missing.
            still = self._lease_dram(missing, held, out)
            self._count(self._hits, "peer", len(missing) - len(still))
            missing = []
        if missing and self.peers is not None:
            try:
                got = self.peers.fetch([ObjectKey.unpack(k) for k in missing])
            except Exception as e:  # peers failing is a miss
                log.warning("peer fetch failed: %s", e)
                got = {}
            wanted = set(missing)
            for key, blob in got.items():
                kb = key.pack() if isinstance(key, ObjectKey) else b""
                if kb not in wanted or kb in out:
                    continue
                try:
                    _verify(kb, blob)
                except SegmentError as e:
                    log.warning("peer sent a bad segment for %s: %s", key, e)
                    self._add(decode_failures=1)
                    reasons[kb] = f"corrupt (peer): {type(e).__name__}: {e}"
                    continue
                self._count(self._hits, "peer")
                self._admit(kb, bytes(blob))
                out[kb] = bytes(blob)
        return out

    def _decode_gpu(self, eng: _Engine, items: list, bad: dict[int, str],
                    arena_ids: set[int]) -> tuple[list, tuple[int, int, int]]:
        """Segments through the GPU codec engine, in batches: ``(ci, seg, ch, h, blob, kb)`` items, ``h``
        None where the header is still to be verified (against key ``kb``, just before the item's batch is
        formed, so that this runs while the GPU works on the previous batch). A header that fails is a miss
        for its chunk (``bad[ci]``), whose later segments are then skipped. ``arena_ids``: the ids of the
        blobs that are arena views. Answers ``(ci, seg, ch, h, error)`` per segment that failed, and the segments decoded with their
        decoded and stored bytes (headers included); the GPU blocks are written when this returns, except
        those of irregular layouts, queued on the current stream (the caller synchronises it)."""

        def verified() -> Iterator[tuple]:
            for ci, seg, ch, h, blob, kb in items:
                if ci in bad:
                    continue
                if h is None:
                    try:
                        h = _verify_header(kb, blob)
                        if h.original_length != len(ch.blocks) * seg.block_bytes or h.dtype != seg.dtype:
                            # phase 1 read other size fields: the bytes changed under the lease
                            raise SegmentError(f"header changed: {h.original_length} bytes of {h.dtype}")
                    except SegmentError as e:
                        self._add(decode_failures=1)
                        bad[ci] = f"corrupt: {type(e).__name__}: {e}"
                        continue
                yield ci, seg, ch, h, blob

        # One engine, the registration's: a decode takes the rotation seed from each segment's header, so
        # exact and TurboQuant segments share batches.
        seed = eng.reg.rotation_seed
        jobs = self._codec_batches(verified(), lambda it: _decode_bound(it[3]), lambda it: it[3].original_length,
                                   self._flights(eng, restore=True))
        # Pipelined: batch i+1 is uploaded and decoding on the GPU while the host takes batch i's verdicts
        # and queues its block copies (one stream: they run after it). A temporary freed meanwhile goes back
        # to that stream's pool, so only later work on the stream reuses it.
        failed: list = []
        totals = [0, 0, 0]
        self._decode_pipelined(jobs, lambda batch: self._decode_start(seed, batch, arena_ids, None),
                               lambda started: self._decode_end(*started, failed, totals))
        return failed, (totals[0], totals[1], totals[2])

    def _decode_pipelined(self, jobs: Iterable, start: Callable, end: Callable) -> None:
        """``_pipelined`` decode batches whose ``end`` answers the event after the batch's block copies
        (or None); returns once every block copy has run."""
        copies: list = []  # the event after each batch's block copies

        def ended(started: tuple) -> None:
            ev = end(started)
            if ev is not None:
                copies.append(ev)

        try:
            _pipelined(jobs, start, ended)
        finally:
            if copies:
                w0 = time.perf_counter()
                copies[-1].synchronize()  # every block copy queued so far has run (one stream, in order)
                self._add(restore_gpu_wait_seconds=time.perf_counter() - w0)

    def _decode_gpu_rows(self, eng: _Engine, rows: "_Rows", bad: dict[int, str],
                         earlies: Sequence[_Early] = ()) -> tuple[list, tuple[int, int, int]]:
        """:meth:`_decode_gpu` of a restore given as :class:`_Rows`: batches cut from the size arrays, each
        batch's headers verified as one array (:meth:`_verified_rows`) while the GPU works on the previous
        batch, and decoded from the arena as arrays (``decode_rows_submit``; ANS chunk tables parsed from the
        arena in one pass); a batch the engine leaves to its per-segment path (a segment over half its
        workspace), or any batch when the arena is not pinned or the pages are not regular rows, goes through
        :meth:`_decode_start` as items. ``earlies``: the first batches, already started (:meth:`_start_early`);
        the cuts go on from the last one's end. Answers as :meth:`_decode_gpu`."""
        seed = eng.reg.rotation_seed
        targets = earlies[0].targets if earlies else self._row_targets(eng, rows.chunks, rows.segs)
        failed: list = []
        totals = [0, 0, 0]

        def start(cut: "tuple[int, int] | _Early") -> "tuple | None":
            if isinstance(cut, _Early):
                return cut.started
            got = self._verified_rows(rows, cut[0], cut[1], bad)
            if got is None:
                return None
            at, tid, templates = got
            if targets is not None:
                started = self._rows_submit(seed, targets, rows, at, tid, templates)
                if started is not None:
                    return started
            items, ids = self._row_items(rows, at, tid, templates)
            return ("items",) + self._decode_start(seed, items, ids, rows.sizes[at])

        def end(started: tuple) -> object:
            if started[0] == "items":
                return self._decode_end(*started[1:], failed, totals)
            return self._rows_end(rows, *started[1:], failed, totals)

        first = earlies[-1].end if earlies else 0
        cuts: Iterable = ((i + first, j + first) for i, j in self._cuts(rows.sizes[first:, 0], rows.sizes[first:, 1],
                                                                        self._flights(eng, restore=True, rows=True),
                                                                        len(rows.segs), first))
        self._decode_pipelined(chain(earlies, cuts), start, end)
        return failed, (totals[0], totals[1], totals[2])

    def _row_targets(self, eng: _Engine, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg]) -> "_Targets | None":
        """The destinations of a restore's rows in GPU pages (None: the arena is not pinned, or the pages are not
        regular rows: the batches then go as items)."""
        if not self.dram.arena.pinned:
            return None
        # a layer-by-layer restore names fewer segments than the registration's geometry rows
        return _Targets.of(chunks, segs, eng.geometry if segs is eng.segs else None)

    def _rows_submit(self, seed: int, targets: _Targets, rows: "_Rows", at: np.ndarray, tid: np.ndarray,
                     templates: list[SegmentHeader], *, direct: bool = True) -> "tuple | None":
        """Start decoding verified rows ``at`` with ``decode_rows_submit`` (``direct``: as there), their workspace
        counted: ``("rows", at, tid, templates, batch, workspace bytes, seconds)``, the batch being the engine's
        exception when its call failed (every row of it then fails); None (nothing started, nothing counted) when
        the engine leaves them to the per-segment path."""
        ws = int(rows.sizes[at, 1].sum())
        self._workspace_delta(ws)
        t0 = time.perf_counter()
        src = self.dram.arena.base_address + HEADER_SIZE + rows.sizes[at, 4]
        try:
            db = self._gpu_codecs.decode_rows_submit(targets, at, rows.heads[at], src, seed,
                                                     within=self.dram.arena.buf, direct=direct)
        except Exception as e:  # the engine failed as a whole: every segment of the batch misses
            db = e
        if db is None:
            self._workspace_delta(-ws)
            return None
        return "rows", at, tid, templates, db, ws, time.perf_counter() - t0

    def _early_heads(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg]) -> list[int]:
        """The ends (in chunks) of a restore's early parts: its first ``EARLY_BATCHES`` codec batches' chunks, each
        part leased and checked and its batch started before the next part and the rest (:meth:`_start_early`).
        A part holds one batch (:meth:`_early_head`); only parts that leave a rest after them, none when a
        batch holds the whole request."""
        head = self._early_head(chunks, segs)
        return [n * head for n in range(1, EARLY_BATCHES + 1) if n * head < len(chunks)] if head else []

    def _early_head(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg]) -> int:
        """How many leading chunks of a restore hold its first codec batch (``batch_segments`` segments, cut as
        :meth:`_cuts` cuts them: not a sliver of a chunk; fewer where their decoded bytes reach the batch's
        source cap first), when the request holds more than that; 0 otherwise."""
        if not segs or not self.dram.arena.pinned:
            return 0
        cap, nseg = self._config.batch_segments, len(segs)
        whole, part = divmod(cap, nseg)
        head = whole if whole and ALIGN_SHARE * part <= cap else whole + (part > 0)
        # Large segments: the source cap (decoded bytes, known from the destinations) ends the batch sooner.
        most, row_bytes, total = self._source_cap(), sum(s.block_bytes for s in segs), 0
        for n, ch in enumerate(chunks[:head], 1):
            total += len(ch.blocks) * row_bytes
            if total >= most:
                head = n
                break
        return head if head < len(chunks) else 0

    def _start_early(self, eng: _Engine, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], keys: list[list[bytes]],
                     head: int, checked: tuple[np.ndarray, np.ndarray, np.ndarray],
                     earlies: Sequence[_Early] = ()) -> "_Early | None":
        """Start the next decode batch of a restore whose first ``head`` chunks alone are leased and their size
        fields ``checked`` (:meth:`_check_device_batch`), so that the GPU copies it while the host leases and
        checks the rest: the batch cut from the end of ``earlies`` (the batches started so far) within those
        chunks. Started only when it is certain to be the rows path's next batch and to write nothing before
        the rest is checked: every segment of those chunks is a DRAM extent whose fields fit, every header of
        the batch verifies, and no row is decoded straight into its pages (all go through the temporary,
        scattered when the batch ends). None when not started (nothing then was)."""
        fit, heads, sizes = checked
        if not fit.all():
            return None
        targets = earlies[0].targets if earlies else self._row_targets(eng, chunks, segs)
        if targets is None:
            return None
        rows = _Rows.of(chunks[:head], segs, keys[:head], heads, sizes)
        first = earlies[-1].end if earlies else 0
        i, j = next(self._cuts(sizes[first:, 0], sizes[first:, 1], self._flights(eng, restore=True, rows=True),
                               len(segs), first))
        i, j = i + first, j + first
        ok, tid, templates = _verify_headers(heads[i:j], rows.layers[i:j], rows.roles[i:j], sizes[i:j, 3])
        if not ok.all():  # a bad header: the usual path reports it
            return None
        started = self._rows_submit(eng.reg.rotation_seed, targets, rows, np.arange(i, j), tid, templates,
                                    direct=False)
        if started is None:
            return None
        early = _Early(targets, j, started)
        if isinstance(started[4], Exception):  # let the usual path meet (and report) the failure
            self._abort_early([early])
            return None
        return early

    def _abort_early(self, earlies: Sequence[_Early]) -> None:
        """End early batches that the restore will not use: wait for their GPU work (it reads leased extents and
        writes their temporaries only), drop their results, give back their workspace."""
        for early in earlies:
            db, ws = early.started[4], early.started[5]
            try:
                if not isinstance(db, Exception):
                    db.engine.decode_collect(db.job)
            except Exception:  # its results are dropped either way
                pass
            finally:
                self._workspace_delta(-ws)

    def _verified_rows(self, rows: "_Rows", i: int, j: int,
                       bad: dict[int, str]) -> "tuple[np.ndarray, np.ndarray, list[SegmentHeader]] | None":
        """Rows ``[i, j)`` of a restore, their headers verified as one array (:func:`_verify_headers`: against
        their keys and extents, as :func:`_verify_header`). A header that fails is a miss for its chunk
        (``bad``, with :func:`_verify_header`'s reason); the rows of chunks in ``bad`` are left out. Answers the
        rows kept, their header templates' indices and the templates (a kept row's header is its template with
        its own payload CRC), or None when no row is kept."""
        ok, tid, templates = _verify_headers(rows.heads[i:j], rows.layers[i:j], rows.roles[i:j], rows.sizes[i:j, 3])
        at = np.arange(i, j)
        nseg = len(rows.segs)
        for r in at[~ok].tolist():
            ci, si = divmod(r, nseg)
            try:
                _verify_header(rows.keys[ci][si], self.dram.view(int(rows.sizes[r, 4]), int(rows.sizes[r, 3])))
                err: SegmentError = SegmentError("header failed the batch check")
            except SegmentError as e:
                err = e
            self._add(decode_failures=1)
            bad.setdefault(ci, f"corrupt: {type(err).__name__}: {err}")
        keep = ok & ~np.isin(at // nseg, list(bad)) if bad else ok
        if not keep.all():
            at, tid = at[keep], tid[keep]
        return (at, tid, templates) if len(at) else None

    def _row_items(self, rows: "_Rows", at: np.ndarray, tid: np.ndarray,
                   templates: list[SegmentHeader]) -> tuple[list, set[int]]:
        """Rows ``at`` (verified: :meth:`_verified_rows`) as :meth:`_decode_start` items ``(ci, seg, chunk,
        header, arena view)``, and the ids of those views."""
        nseg = len(rows.segs)
        items, ids = [], set()
        for r, h in zip(at.tolist(), _row_headers(rows, at, tid, templates)):
            ci, si = divmod(r, nseg)
            blob = memoryview(self.dram.view(int(rows.sizes[r, 4]), int(rows.sizes[r, 3])))
            ids.add(id(blob))
            items.append((ci, rows.segs[si], rows.chunks[ci], h, blob))
        return items, ids

    def _rows_end(self, rows: "_Rows", at: np.ndarray, tid: np.ndarray, templates: list[SegmentHeader], db,
                  ws: int, seconds: float, failed: list, totals: list[int]) -> object:
        """:meth:`_decode_end` of a batch of rows: its failed segments appended to ``failed`` as ``(ci, seg,
        ch, h, error)``, the segments decoded and their decoded and stored bytes added to ``totals``. Answers
        the event after its block copies (None when there are none)."""
        errs, ev = self._collect_batch(db, self._gpu_codecs.decode_rows_finish, len(at), ws, seconds)
        ok = np.ones(len(at), dtype=bool)
        if errs.count(None) != len(errs):
            bad = [j for j, err in enumerate(errs) if err is not None]
            ok[bad] = False
            for j, h in zip(bad, _row_headers(rows, at[bad], tid[bad], templates)):
                ci, si = divmod(int(at[j]), len(rows.segs))
                failed.append((ci, rows.segs[si], rows.chunks[ci], h, errs[j]))
        totals[0] += int(ok.sum())
        totals[1] += int(rows.sizes[at[ok], 1].sum())
        totals[2] += int(rows.sizes[at[ok], 2].sum())
        return ev

    def _cuts(self, nbytes: np.ndarray, logical: np.ndarray, flights: int = 1, per: int = 0,
              start: int = 0) -> Iterator[tuple[int, int]]:
        """The ``[i, j)`` ranges of :meth:`_codec_batches` over items of ``nbytes`` and ``logical`` bytes (at
        most ``batch_segments`` items, ``nbytes`` within the budget of ``flights`` flights, ``logical`` within
        the source cap, one item at least), found on the arrays' running sums. With ``per``, the items come in
        chunks of ``per`` (item ``i`` of chunk ``(start + i) // per``: a restore's rows from row ``start``), and a
        batch cut at ``batch_segments`` does not split a chunk for a sliver of it, as ``_codec_batches`` ' ``run``
        rule (:data:`ALIGN_SHARE`): then a restore's batches repeat one sequence of segments, which the header
        checks and the engine's decode plans answer from their memos. A batch the bytes cut is left as it is:
        its segments' sizes differ (ANS) and no memo would answer it, while smaller batches cost more of them
        (`ans` restored 8% slower with them, docs/results/2026-12-03-restore-host)."""
        budget, most = self._batch_budget(flights), self._source_cap()
        limit = self._config.batch_segments
        cn = np.cumsum(nbytes, dtype=np.int64)
        cl = np.cumsum(logical, dtype=np.int64)
        n, i = len(cn), 0

        def total(c: np.ndarray, a: int, b: int) -> int:  # the items a .. b - 1
            return int(c[b - 1]) - (int(c[a - 1]) if a else 0)

        while i < n:
            j = min(i + limit, n,
                    int(np.searchsorted(cn, (int(cn[i - 1]) if i else 0) + budget, side="right")),
                    int(np.searchsorted(cl, (int(cl[i - 1]) if i else 0) + most, side="right")))
            j = max(j, i + 1)
            if per and i + limit == j < n:
                c0 = j - (start + j) % per  # the chunk the cut falls in
                c1 = min(c0 + per, n)
                if (i < c0 < j and ALIGN_SHARE * (j - c0) <= j - i and c1 - c0 <= limit
                        and total(cn, c0, c1) <= budget and total(cl, c0, c1) <= most):
                    j = c0  # a chunk one batch holds whole, begun short: whole to the next batch
            yield i, j
            i = j

    def _check_device_batch(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], keys: list[list[bytes]],
                            spans: Spans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The size fields of a restore's DRAM-leased sources bound for the GPU engine, read as one array: the
        dtype and source length each header names against what its destination blocks take, its stored
        length against its extent. Answers per segment (chunk-major) whether they fit (False: not in DRAM, or
        fields that do not fit: the per-segment path says why, and whether it is a miss or a wrong request),
        the header rows ``[n, 64]``, and per segment its batch bytes (its payload), decoded bytes,
        stored bytes, extent length and arena offset, ``[n, 5]``. The rest of each header is verified batch by
        batch (:meth:`_verified_rows`). ``spans`` holds the extents of ``keys`` (chunk-major, as leased)."""
        assert len(spans.hit) == len(chunks) * len(segs), "spans of another request"
        at = np.flatnonzero(spans.hit)
        codes = np.fromiter((-1 if s.dtype_code is None else s.dtype_code for s in segs), np.int64, len(segs))
        block_bytes = np.fromiter((s.block_bytes for s in segs), np.int64, len(segs))
        nblocks = np.fromiter((len(ch.blocks) for ch in chunks), np.int64, len(chunks))
        return read_sizes(self.dram.arena.buf, at, spans.offs[at], spans.lens[at], codes, block_bytes, nblocks)

    def _decode_start(self, seed: int, batch: list, arena_ids: set[int], sizes: "np.ndarray | None") -> tuple:
        if sizes is None:
            ws = sum(h.original_length for _, _, _, h, _ in batch)
            stored = sum(h.stored_length for _, _, _, h, _ in batch) + HEADER_SIZE * len(batch)
        else:
            ws, stored = int(sizes[:, 1].sum()), int(sizes[:, 2].sum())
        if self.dram.arena.pinned:
            pinned = [id(blob) in arena_ids or self._pinned(blob) for *_, blob in batch]
        else:  # no view is pinned
            pinned = [False] * len(batch)
        self._workspace_delta(ws)
        t0 = time.perf_counter()
        try:
            db = self._gpu_codecs.decode_submit([(seg, ch.blocks, blob, h) for _, seg, ch, h, blob in batch], seed,
                                                pinned)
        except Exception as e:  # the engine failed as a whole: every segment of the batch misses
            db = e
        return batch, db, ws, stored, time.perf_counter() - t0

    def _collect_batch(self, db, finish: Callable, n: int, ws: int, seconds: float) -> tuple[list, object]:
        """Wait for a decode batch of ``n`` segments (``finish(db)``: its error or None per segment, and the
        event after its block copies), give back the ``ws`` workspace bytes counted for it and count its
        time. A batch whose engine call failed (``db`` is the exception) or whose collection raised fails
        every one of its segments with that error."""
        t0 = time.perf_counter()
        ev = None
        try:
            if isinstance(db, Exception):
                errs = [db] * n
            else:
                try:
                    errs, ev = finish(db)
                except Exception as e:
                    errs = [e] * n
        finally:
            self._workspace_delta(-ws)
        self._add_per_segment("decode_seconds", seconds + time.perf_counter() - t0, n)
        return errs, ev

    def _decode_end(self, batch: list, db, ws: int, stored: int, seconds: float, failed: list,
                    totals: list[int]) -> object:
        """Ends a batch of :meth:`_decode_start`: its failed segments appended to ``failed`` as ``(ci, seg,
        ch, h, error)``, the segments decoded and their decoded and stored bytes added to ``totals``.
        Answers the event after its block copies (None when there are none)."""
        errs, ev = self._collect_batch(db, self._gpu_codecs.decode_finish, len(batch), ws, seconds)
        count, logical = len(batch), ws
        if any(e is not None for e in errs):
            count = logical = stored = 0
            for (ci, seg, ch, h, _), err in zip(batch, errs):
                if err is None:
                    count += 1
                    logical += h.original_length
                    stored += HEADER_SIZE + h.stored_length
                else:
                    failed.append((ci, seg, ch, h, err))
        totals[0] += count
        totals[1] += logical
        totals[2] += stored
        return ev

    def _restore_ssd_device(self, eng: _Engine, items: list[tuple[int, _Seg, ChunkBlocks, bytes]],
                            bad: dict[int, str], reasons: dict[bytes, str]) -> tuple[list, set[bytes]]:
        """The cuFile direct path of a restore: ``(ci, seg, chunk, key)`` items whose segments only the SSD
        tier holds and whose destinations are GPU pages. Their records are read into device memory
        (``read_many_device``), the record headers checked on the host, and the GPU engine checks each
        payload's CRC32C and decodes it from where it lies, into a device temporary; a chunk's temporaries
        are scattered into its blocks only when every one of its segments decoded, so a chunk with a bad
        record is a miss (``bad[ci]``, the lower tier's reason) with nothing written to its blocks. Chunks
        already in ``bad`` are skipped. Works in windows of whole chunks within the codec budget (decoded
        and record bytes). Raises :class:`RequestError`, before reading anything, when a record's size does
        not fit its destination blocks.

        These segments are not readmitted to DRAM: that would bring every one back to the host, the
        bounce this path exists to avoid (a later lookup promotes them through the host path as usual).
        Answers the ``done`` entries of the segments written (their copies into GPU blocks queued on the
        current stream) and their keys."""
        if not items:
            return [], set()
        import cupy

        from ..tiers.ssd.record import record_length

        items = [it for it in items if it[0] not in bad]
        info = self.lower.describe([ObjectKey.unpack(kb) for *_, kb in items])
        by_chunk: dict[int, list[tuple[_Seg, ChunkBlocks, bytes, int, int]]] = {}
        for (ci, seg, ch, kb), got in zip(items, info):
            if got is None:  # evicted or invalidated since _acquire saw it
                bad.setdefault(ci, reasons.get(kb, "missing"))
                continue
            original, seg_len = got
            want = len(ch.blocks) * seg.block_bytes
            if original != want:
                raise RequestError(
                    f"chunks[{ci}]: layer {seg.layer} {seg.role.name.lower()} holds {original} bytes, the "
                    f"{len(ch.blocks)} destination blocks take {want} bytes")
            by_chunk.setdefault(ci, []).append((seg, ch, kb, original, seg_len))
        budget = self._config.storage_codec_budget
        windows: list[list[int]] = []
        dec = rec = 0
        for ci, group in by_chunk.items():
            if ci in bad:
                continue
            d, r = sum(g[3] for g in group), sum(record_length(g[4]) for g in group)
            if not windows or dec + d > budget or rec + r > budget:
                windows.append([])
                dec = rec = 0
            windows[-1].append(ci)
            dec, rec = dec + d, rec + r
        seed = eng.reg.rotation_seed
        done: list = []
        served: set[bytes] = set()
        for window in windows:
            flat = [(ci, seg, ch, kb, original, seg_len) for ci in window
                    for seg, ch, kb, original, seg_len in by_chunk[ci]]
            tmps = [cupy.empty(f[4], dtype=cupy.uint8) for f in flat]
            errors: dict[int, Exception] = {}
            ws = sum(f[4] for f in flat)
            self._workspace_delta(ws)

            def sink(batch: list) -> list[int]:
                t0 = time.perf_counter()
                try:
                    errs = self._gpu_codecs.decode_device([v for _, v in batch], [tmps[j] for j, _ in batch], seed)
                except Exception as e:  # the engine failed as a whole: the window misses, nothing invalidated
                    errs = [e] * len(batch)
                self._add_per_segment("decode_seconds", time.perf_counter() - t0, len(batch))
                rejected = []
                for (j, _), err in zip(batch, errs):
                    if err is None:
                        continue
                    errors[j] = err
                    if isinstance(err, SegmentError):  # the payload (CRC32C) or its header: the record is corrupt
                        rejected.append(j)
                return rejected

            try:
                verdicts = self.lower.read_many_device([ObjectKey.unpack(f[3]) for f in flat], sink, max_bytes=budget)
                failed: dict[int, str] = {}
                for j, ((ci, seg, ch, kb, _, _), why) in enumerate(zip(flat, verdicts)):
                    err = errors.get(j)
                    if err is not None and not isinstance(err, SegmentError):  # a decode failure, not the record
                        log.warning("decode failed for chunk %s layer %d: %s", ch.key.hex(), seg.layer, err)
                        self._add(decode_failures=1)
                        failed.setdefault(ci, f"decode: {type(err).__name__}: {err}")
                    elif why == "absent":
                        failed.setdefault(ci, reasons.get(kb, "missing"))
                    elif why is not None or err is not None:
                        failed.setdefault(ci, "lower tier: record failed validation or could not be read")
                for j, (ci, seg, ch, kb, original, seg_len) in enumerate(flat):
                    if ci in failed:
                        continue
                    src = tmps[j].view(cupy_dtype(seg.dtype)).reshape((len(ch.blocks),) + seg.block_shape)
                    seg.scatter(ch.blocks, src)
                    served.add(kb)
                    # restore() counts sizes from the header; these two fields are what it reads.
                    done.append((ci, seg, ch, _Sizes(original, seg_len - HEADER_SIZE), None))
                for ci, why in failed.items():
                    bad.setdefault(ci, why)
            finally:
                self._workspace_delta(-ws)
        self._count(self._hits, "lower", len(served))
        self._add(ssd_direct_reads=len(served))
        return done, served

    def _arena_offset(self, blob) -> int | None:
        """The arena offset of ``blob`` when it is a view of the arena, else None."""
        if not isinstance(blob, memoryview) or not len(blob):
            return None
        off = host_address(blob) - self.dram.arena.base_address
        return off if 0 <= off and off + len(blob) <= self.dram.arena.size else None

    def _pinned(self, blob) -> bool:
        """``blob`` is a view of the arena, and the arena is pinned (the GPU copies from it directly)."""
        return self.dram.arena.pinned and self._arena_offset(blob) is not None

    def _upload_raw(self, items: list, keep: list) -> list:
        """Raw segments into GPU blocks: per batch, the payloads are packed into one pinned buffer, sent
        with one host-to-device copy, then scattered on the device, all queued on the current stream.
        The pinned buffers go to ``keep``: the caller holds them until it has synchronised the stream."""
        import cupy

        out = []
        for batch in self._codec_batches(items, lambda it: it[3].stored_length):
            total = sum(h.stored_length for _, _, _, h, _ in batch)
            res: list = []
            self._workspace_delta(2 * total)
            try:
                host = np.frombuffer(cupy.cuda.alloc_pinned_memory(total), np.uint8, total)
                keep.append(host)
                pos = 0
                for _, _, _, h, blob in batch:
                    host[pos:pos + h.stored_length] = np.frombuffer(blob, np.uint8, h.stored_length, HEADER_SIZE)
                    pos += h.stored_length
                dev = cupy.empty(total, dtype=cupy.uint8)
                stream = cupy.cuda.get_current_stream()
                cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, total,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                pos = 0
                for ci, seg, ch, h, _ in batch:
                    src = dev[pos:pos + h.stored_length].view(cupy_dtype(seg.dtype))
                    seg.scatter(ch.blocks, src.reshape((len(ch.blocks),) + seg.block_shape))
                    res.append((ci, seg, ch, h, None))
                    pos += h.stored_length
            except Exception as e:  # a CUDA failure: the whole batch misses
                res = [(ci, seg, ch, h, e) for ci, seg, ch, h, _ in batch]
            finally:
                self._workspace_delta(-2 * total)
            out += res
        return out

    def _write(self, seg: _Seg, blocks: list[int], h: SegmentHeader, blob: memoryview) -> None:
        """Decode a verified segment into the chunk's destination blocks on the host (GPU blocks get
        their copies queued on the current stream)."""
        payload = blob[HEADER_SIZE:HEADER_SIZE + h.stored_length]
        if h.format == Format.RAW:
            flat = np.frombuffer(payload, dtype=h.dtype)
        else:
            t0 = time.perf_counter()
            flat = decode_payload(h, payload)
            self._workspace_delta(flat.nbytes)
            self._add(decode_seconds=time.perf_counter() - t0)
        try:
            src = flat.view(seg.dtype).reshape((len(blocks),) + seg.block_shape)
            if not seg.on_host:  # GPU pages without the GPU codec engine
                import cupy

                src = cupy.asarray(src.view(cupy_dtype(seg.dtype)))
            seg.scatter(blocks, src)
        finally:
            if h.format != Format.RAW:
                self._workspace_delta(-flat.nbytes)
