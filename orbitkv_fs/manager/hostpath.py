"""The host path of exact segments, as batches: save and restore of raw segments of host pages with one
Python call per batch per stage, not per segment.

Primitives: :meth:`HostPath._save_raw_batch` (a batch of exact segments of host pages: one reservation
round, each segment gathered straight into its arena extent and its payload CRC32C taken there while the
bytes are in cache, every header written at once from its template row with its CRC computed as an
array, one publish round of columns in request order); :meth:`HostPath._check_host_batch` (a restore's
DRAM-leased sources against the raw headers their destinations expect, every header compared and
CRC-checked as one array, the chunks that pass answered as :class:`HostRows`) and
:meth:`HostPath._write_host_batch` (a window of chunks at a time: each payload CRC32C, then the scatter into
the engine's blocks). Keys, offsets, lengths and CRCs are arrays per batch; per-segment Python is left to the two C
calls a segment needs (its copy, its CRC32C) and to the segments that fail, which go to the
per-segment path with its typed errors.

Invariants: the segment bytes are exactly the per-segment path's (header templates from
:func:`~orbitkv_fs.segment.header_row`, CRCs from :func:`~orbitkv_fs.segment.header_crcs`); nothing is
published before its bytes, header and CRCs are in place; a batch that fails returns every reservation it
still holds; a restore writes a chunk only once every segment of it passed its CRC32C, and a source this
path does not recognise (another format, another header, a tier other than DRAM) is checked in full by the
per-segment path instead.
"""

from __future__ import annotations

import collections
import time
from itertools import accumulate, compress
from operator import itemgetter
from typing import NamedTuple, Sequence

import crc32c as _crc32c
import numpy as np

from ..codecs import raw_segment
from ..segment import HEADER_DTYPE, HEADER_SIZE, MAX_STORED_BYTES, Format, RawReason, header_crcs
from ..tiers.dram import UNIT, units_of
from .api import ChunkBlocks, RequestError
from .leases import Spans
from .device import _gather_host
from .registry import _Seg
from .save import _KEY, _SEG, _SaveAcc

_ROW = np.arange(HEADER_SIZE, dtype=np.int64)
#: Header bytes a template fixes: all but the payload CRC (24..27) and the header's own CRC (60..63).
_FIXED = np.r_[0:24, 28:60]
_RAW = int(Format.RAW)
#: Payload bytes a restore checks before it writes them: a window that stays in the last-level cache.
_WINDOW_BYTES = 8 << 20


def _consecutive(chunks: Sequence[ChunkBlocks]) -> slice | None:
    """The chunks' blocks, in order, as one slice when they are consecutive block ids; else None."""
    first = t = chunks[0].blocks[0]
    for ch in chunks:
        for b in ch.blocks:
            if b != t:
                return None
            t += 1
    return slice(first, t) if first >= 0 else None


def _group_run(seg: _Seg, chunks: Sequence[ChunkBlocks], offs: Sequence[int | None],
               sizes: Sequence[int]) -> slice | None:
    """The blocks of a group of pieces of ``seg`` (one per chunk, at arena offsets ``offs``, of ``sizes``
    payload bytes) as one slice of its block-major host view, when the pieces are of one size and evenly
    spaced and the chunks, in order, hold consecutive blocks; else None (the group then moves a piece at a
    time). Chunks of different block counts are never one run: each piece holds its own chunk's blocks."""
    if type(seg.base) is not np.ndarray or len(chunks) < 2 or None in offs or sizes.count(sizes[0]) != len(sizes):
        return None
    piece = units_of(sizes[0] + HEADER_SIZE) * UNIT
    if not _evenly(offs, piece):
        return None
    return _consecutive(chunks)


def _pick(seq: Sequence, at: Sequence[int]) -> list:
    """``[seq[i] for i in at]`` in one C call (a batch gathers several columns by the same positions)."""
    return list(itemgetter(*at)(seq)) if len(at) > 1 else [seq[i] for i in at]


def _evenly(offs: Sequence[int], piece: int) -> bool:
    """Whether ``offs`` step by ``piece`` from the first (one list comparison, not a step at a time)."""
    return list(offs) == list(range(offs[0], offs[0] + piece * len(offs), piece))


def _put_headers(buf: np.ndarray, offs: list[int], sizes: list[int], heads: np.ndarray) -> None:
    """Write header rows ``heads`` at arena offsets ``offs`` (of pieces of ``sizes`` payload bytes): one
    strided copy when the pieces are of one size and evenly spaced (a batch carved from one extent), else
    one scatter of every header byte."""
    piece = units_of(sizes[0] + HEADER_SIZE) * UNIT
    first = offs[0]
    if sizes.count(sizes[0]) == len(sizes) and _evenly(offs, piece):
        buf[first:first + len(offs) * piece].reshape(len(offs), piece)[:, :HEADER_SIZE] = \
            heads.view(np.uint8).reshape(-1, HEADER_SIZE)
        return
    buf[np.asarray(offs, dtype=np.int64)[:, None] + _ROW] = heads.view(np.uint8).reshape(-1, HEADER_SIZE)


def _payloads(buf: np.ndarray, first: int, count: int, n: int, seg: _Seg) -> np.ndarray:
    """The ``n``-byte payloads of ``count`` evenly spaced pieces from arena offset ``first``, as
    ``[count, blocks, *block_shape]`` of the segment's dtype."""
    piece = units_of(n + HEADER_SIZE) * UNIT
    rows = buf[first:first + count * piece].reshape(count, piece)[:, HEADER_SIZE:HEADER_SIZE + n]
    return rows.view(seg.dtype).reshape((count, n // seg.block_bytes) + seg.block_shape)


def _blocks(seg: _Seg, run: slice, count: int) -> np.ndarray:
    """The blocks ``run`` (``_group_run``'s slice) of ``seg``'s block-major host view, as ``count`` pieces:
    ``[count, blocks, *block_shape]``."""
    return seg.base[run].reshape((count, (run.stop - run.start) // count) + seg.block_shape)


class HostRows(NamedTuple):
    """Chunks of a restore whose exact segments :meth:`HostPath._check_host_batch` found in DRAM, headers
    checked: their indices, and per chunk and segment (``[chunk, seg]``) the arena offset, payload bytes and
    payload CRC32C (still to be checked)."""

    chunks: list[int]
    offs: np.ndarray
    sizes: np.ndarray
    pcrc: np.ndarray

    @classmethod
    def none(cls, nseg: int) -> "HostRows":
        empty = np.zeros((0, nseg), dtype=np.int64)
        return cls([], empty, empty, empty.astype(np.uint32))


class HostPath:
    """Batches of exact segments of host pages."""

    def _raw_batch_cap(self) -> tuple[int, int]:
        """Segments and bytes of one raw batch: a codec batch, and at most an eighth of the pool (whose
        earlier batches it may have to evict: a reservation cannot evict its own batch)."""
        return self._config.batch_segments, min(self._batch_budget(), self.dram.capacity // 8)

    def _save_raw_batch(self, items: list[tuple[ChunkBlocks, _Seg, bytes]], acc: _SaveAcc) -> None:
        """Save exact segments of host pages: reserve every extent in one round, gather each segment into
        its extent and take its payload CRC32C there, write the headers from their template rows, publish in
        one round. A segment that found no room goes to the lower tier (or is dropped), as one at a time."""
        c0 = time.thread_time()
        k = len(items)
        # Segment-major: the pieces of one (layer, role) lie side by side in the batch's extent, so that a
        # group whose chunks hold consecutive blocks moves with one copy (_group_run).
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(id(it[1]), []).append(i)
        order = [i for g in groups.values() for i in g]  # segment-major position -> request position
        group_ends = list(accumulate(map(len, groups.values())))
        req, items = items, _pick(items, order)
        req_sizes = [len(ch.blocks) * seg.block_bytes for ch, seg, _ in req]
        sizes = _pick(req_sizes, order)
        if max(sizes) > MAX_STORED_BYTES:
            n = next(n for n in sizes if n > MAX_STORED_BYTES)
            raise RequestError(f"chunk of {n // items[sizes.index(n)][1].block_bytes} blocks makes a {n}-byte "
                               f"segment, over the {MAX_STORED_BYTES}-byte bound")
        offs = self.dram.reserve_many([n + HEADER_SIZE for n in sizes])
        buf = self.dram.arena.buf
        tmpl: dict[tuple[int, int], int] = {}  # (seg, payload bytes) -> template row
        rows: list[bytes] = []  # raw bytes: concatenating structured rows costs a field promotion each
        bases: list[int] = []
        # per segment placed (segment-major): its position, payload CRC, template row
        live: list[int] = []
        crcs: list[int] = []
        tids: list[int] = []
        done: list[bool] = []
        pub: list[int] = []  # the positions placed, in request order: what publish_many takes

        def template(seg: _Seg, n: int) -> int:
            t = tmpl.get((id(seg), n))
            if t is None:
                row, base = seg.raw_header(n)
                t = tmpl[(id(seg), n)] = len(rows)
                rows.append(row.tobytes())
                bases.append(base)
            return t

        try:
            crc = _crc32c.crc32c
            with memoryview(buf) as mv:
                start = 0
                for end in group_ends:
                    seg = items[start][1]
                    run = _group_run(seg, [it[0] for it in items[start:end]], offs[start:end], sizes[start:end])
                    if run is not None:  # one copy for the group (at most a batch: it stays in cache), every
                        # piece placed and of one size: its CRCs right after the copy, while the bytes are in cache
                        n = sizes[start]
                        np.copyto(_payloads(buf, offs[start], end - start, n, seg), _blocks(seg, run, end - start))
                        crcs += [crc(mv[o + HEADER_SIZE:o + HEADER_SIZE + n]) for o in offs[start:end]]
                        tids += [template(seg, n)] * (end - start)
                        live += range(start, end)
                        start = end
                        continue
                    for i in range(start, end):
                        off, n = offs[i], sizes[i]
                        if off is None:
                            continue
                        ch = items[i][0]
                        p = off + HEADER_SIZE
                        seg.gather_into(ch.blocks, buf[p:p + n].view(seg.dtype).reshape((len(ch.blocks),) + seg.block_shape))
                        crcs.append(crc(mv[p:p + n]))
                        tids.append(template(seg, n))
                        live.append(i)
                    start = end
            whole = len(live) == k  # every segment placed: live is range(k)
            if live:
                tid = np.asarray(tids, dtype=np.intp)
                pcrc = np.asarray(crcs, dtype=np.uint32)
                heads = np.frombuffer(b"".join(rows), dtype=HEADER_DTYPE)[tid]
                heads["payload_crc"] = pcrc
                heads["header_crc"] = header_crcs(np.asarray(bases, dtype=np.uint32)[tid], pcrc)
                _put_headers(buf, offs if whole else _pick(offs, live), sizes if whole else _pick(sizes, live), heads)
            # Request order (chunk-major; the copies went segment-major): the index places a chunk's new
            # segments in one step (ObjectIndex.add_many), where a run of one chunk takes its per-key path,
            # and the eviction policy ages chunks in publication order.
            back = np.empty(k, dtype=np.intp)
            back[order] = np.arange(k)
            if whole:  # the request's own keys and sizes, in its order
                pub = back.tolist()
                pub_keys, pub_sizes = list(map(_KEY, req)), req_sizes
            else:
                pub = back[np.isin(back, live)].tolist()
                pub_keys, pub_sizes = list(map(_KEY, _pick(items, pub))), _pick(sizes, pub)
            c1 = time.thread_time()
            self.dram.publish_many(pub_keys, _pick(offs, pub), [n + HEADER_SIZE for n in pub_sizes], pub_sizes,
                                   [_RAW] * len(pub), done)
        except BaseException:
            # What publish_many did not reach is still reserved; so is everything when it was not called.
            for x in pub[len(done):]:
                self.dram.cancel(offs[x], sizes[x] + HEADER_SIZE)
            started = set(pub)
            for i, off in enumerate(offs):
                if off is not None and i not in started:
                    self.dram.cancel(off, sizes[i] + HEADER_SIZE)
            raise
        # Admissions per batch: the keys as one list, the byte sums, the raw reasons per segment class.
        if False in done:  # some keys were present already: their extents went back
            pub, pub_keys, pub_sizes = (list(compress(col, done)) for col in (pub, pub_keys, pub_sizes))
        published = len(pub)
        acc.admit_batch(pub_keys)
        acc.logical += sum(pub_sizes)
        acc.stored += sum(pub_sizes) + HEADER_SIZE * published
        reasons: collections.Counter[str] = collections.Counter()
        for seg, count in collections.Counter(map(_SEG, _pick(items, pub))).items():
            if seg.raw_reason != RawReason.NONE:
                reasons[seg.raw_reason.name.lower()] += count
        if published:
            self._count(self._codec_segments, "raw", published)
        for name, n in reasons.items():
            acc.raw[name] = acc.raw.get(name, 0) + n
            self._count(self._raw, name, n)
        for i, off in enumerate(offs if None in offs else ()):  # no room in DRAM: one at a time, as before
            if off is None:
                ch, seg, kb = items[i]
                self._demote_direct(kb, raw_segment(_gather_host(seg, ch.blocks), role=seg.role, layer=seg.layer,
                                                    reason=seg.raw_reason), acc)
        c2 = time.thread_time()
        self._cpu("save_encode", c1 - c0, k)
        self._cpu("save_publish", c2 - c1, k)

    def _check_host_batch(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], keys: list[list[bytes]],
                          spans: Spans) -> HostRows:
        """The chunks of a restore into host pages whose every segment is a DRAM extent (``spans``: the
        extents of ``keys``, chunk-major) holding exactly the raw segment its destination expects: header bytes
        equal to its template row but for the payload CRC, the header's CRC32C right, the extent exactly header
        plus payload. Answers those chunks as :class:`HostRows` (payload CRCs still to be checked); the other
        chunks are for the per-segment path."""
        nseg = len(segs)
        if not chunks or not nseg or len(spans) < nseg:
            return HostRows.none(nseg)
        assert len(spans.hit) == len(chunks) * nseg, "spans of another request"
        leased = spans.hit.reshape(len(chunks), nseg).all(axis=1)  # chunks whose every segment is in DRAM
        cand = np.flatnonzero(leased)
        if not len(cand):
            return HostRows.none(nseg)
        at, lens = spans.offs[np.repeat(leased, nseg)], spans.lens[np.repeat(leased, nseg)]
        m = len(cand)
        # template rows: one per (seg, blocks in the chunk)
        nblocks = [len(chunks[ci].blocks) for ci in cand.tolist()]
        sizes_of = {nb: np.asarray([nb * s.block_bytes for s in segs], dtype=np.int64) for nb in set(nblocks)}
        order = {nb: j for j, nb in enumerate(sizes_of)}
        heads = [s.raw_header(int(n)) for nb in sizes_of for s, n in zip(segs, sizes_of[nb])]
        rows = np.concatenate([h[0] for h in heads]).view(np.uint8).reshape(-1, HEADER_SIZE)
        bases = np.asarray([h[1] for h in heads], dtype=np.uint32)
        tid = (np.asarray([order[nb] for nb in nblocks], dtype=np.intp)[:, None] * nseg
               + np.arange(nseg, dtype=np.intp)).reshape(-1)
        sizes = np.concatenate([sizes_of[nb] for nb in sizes_of])[tid]
        got = self.dram.arena.buf[at[:, None] + _ROW]  # every header of the request, one gather
        ok = (got[:, _FIXED] == rows[tid][:, _FIXED]).all(axis=1)
        h = got.view(HEADER_DTYPE).reshape(-1)
        pcrc = h["payload_crc"]
        ok &= h["header_crc"] == header_crcs(bases[tid], pcrc)
        ok &= lens == sizes + HEADER_SIZE
        whole = ok.reshape(m, nseg).all(axis=1)
        return HostRows(cand[whole].tolist(), at.reshape(m, nseg)[whole],
                        sizes.reshape(m, nseg)[whole], pcrc.reshape(m, nseg)[whole])

    def _write_host_batch(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], checked: HostRows,
                          bad: dict[int, str]) -> tuple[int, int]:
        """The chunks of :meth:`_check_host_batch`, a window at a time (payloads that fit in cache): each
        segment's payload CRC32C checked, then the payloads of the chunks that passed scattered into their
        blocks: one copy per (layer, role) where those chunks hold consecutive blocks and their pieces lie
        evenly spaced (saved together), else one per segment. A chunk that fails is a miss (``bad``) with
        none of its blocks written. Answers the segments written and their payload bytes."""
        buf = self.dram.arena.buf
        crc = _crc32c.crc32c
        written = logical = failures = 0
        m = len(checked.chunks)
        ends = np.cumsum(checked.sizes.sum(axis=1))  # payload bytes up to each chunk, for the windows
        at = checked.offs + HEADER_SIZE
        with memoryview(buf) as mv:
            start = 0
            while start < m:
                before = int(ends[start - 1]) if start else 0
                end = max(start + 1, int(np.searchsorted(ends, before + _WINDOW_BYTES, side="right")))
                wrong = [crc(mv[p:p + n]) != c for p, n, c in zip(at[start:end].ravel().tolist(),
                                                                   checked.sizes[start:end].ravel().tolist(),
                                                                   checked.pcrc[start:end].ravel().tolist())]
                good = np.arange(start, end)
                if True in wrong:
                    per_chunk = np.asarray(wrong).reshape(end - start, -1).sum(axis=1)
                    failures += int(per_chunk.sum())
                    for j in np.flatnonzero(per_chunk).tolist():
                        bad[checked.chunks[start + j]] = "corrupt: PayloadChecksumMismatch: payload CRC32C mismatch"
                    good = good[per_chunk == 0]
                start = end
                if not len(good):
                    continue
                try:
                    self._scatter_window(chunks, segs, checked, good)
                except Exception as e:  # a failing copy into the pages: a miss, as on the per-segment path
                    failures += len(good)
                    for j in good.tolist():
                        bad.setdefault(checked.chunks[j], f"decode: {type(e).__name__}: {e}")
                    continue
                written += len(segs) * len(good)
                logical += int(checked.sizes[good].sum())
        if failures:
            self._add(decode_failures=failures)
        return written, logical

    def _scatter_window(self, chunks: Sequence[ChunkBlocks], segs: Sequence[_Seg], checked: HostRows,
                        good: np.ndarray) -> None:
        """Copy the verified payloads of a window's chunks (rows ``good`` of ``checked``) into their blocks."""
        buf = self.dram.arena.buf
        group = [chunks[checked.chunks[j]] for j in good.tolist()]
        offs, sizes = checked.offs[good], checked.sizes[good]  # [chunk, seg]
        run = _consecutive(group) if len(group) > 1 else None
        if run is not None:
            pieces = (sizes[0] + HEADER_SIZE + UNIT - 1) // UNIT * UNIT
            lined = ((sizes == sizes[0]).all(axis=0) & (np.diff(offs, axis=0) == pieces).all(axis=0)).tolist()
        for s, seg in enumerate(segs):
            if run is not None and lined[s] and type(seg.base) is np.ndarray:
                # into a view of the pages (splitting the block axis never copies), not from a reshaped
                # payload view (the header gaps would make that a copy)
                np.copyto(_blocks(seg, run, len(group)), _payloads(buf, int(offs[0, s]), len(group), int(sizes[0, s]), seg))
                continue
            for ch, o, n in zip(group, offs[:, s].tolist(), sizes[:, s].tolist()):
                p = o + HEADER_SIZE
                seg.scatter(ch.blocks, buf[p:p + n].view(seg.dtype).reshape((len(ch.blocks),) + seg.block_shape))
