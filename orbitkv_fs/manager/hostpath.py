"""The host path of exact segments, as batches: save and restore of raw segments of host pages with one
Python call per batch per stage, not per segment.

Primitives: :meth:`HostPath._save_raw_batch` (a batch of exact segments of host pages as
:class:`~orbitkv_fs.manager.save.SaveRows`, the columns a codec batch has: one reservation round,
segment-major; :func:`_group_runs` finds, as arrays over the batch, the (layer, role) groups whose pieces move
with one copy; each payload CRC32C taken in the arena while the bytes are in cache; every header written at
once from its template row (:meth:`HostPath._raw_templates`) with its CRC computed as an array; one publish
round in request order, with the key scan the rows carry); :meth:`HostPath._check_exact_bound` (a chunk whose
exact segment would pass the format's bound, refused before a save reserves anything);
:meth:`HostPath._check_host_batch` (a restore's DRAM-leased sources against the raw headers their
destinations expect, every header compared and CRC-checked as one array, the chunks that pass answered as
:class:`HostRows`) and :meth:`HostPath._write_host_batch` (a window of chunks at a time: each payload CRC32C,
then the scatter into the engine's blocks). Keys, offsets, lengths and CRCs are arrays per batch; per-segment
Python is left to the two C calls a segment needs (its copy or its share of a group's, its CRC32C) and to the
segments that fail, which go to the per-segment path with its typed errors.

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
from itertools import compress
from typing import NamedTuple, Sequence

import crc32c as _crc32c
import numpy as np

from ..codecs import raw_segment
from ..segment import HEADER_DTYPE, HEADER_SIZE, MAX_STORED_BYTES, Format, RawReason, header_crcs
from ..tiers.dram import UNIT, units_of
from .api import ChunkBlocks, RequestError
from .leases import Spans
from .device import _BLOCKS, _gather_host, _run_of
from .registry import _Engine, _Seg
from .save import SaveRows, _SaveAcc

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


def _group_runs(chunks: Sequence[ChunkBlocks], sci: np.ndarray, ssz: np.ndarray, off: np.ndarray,
                starts: np.ndarray) -> list[slice | None]:
    """Per group of a segment-major batch (rows ``starts[g]`` up to the next group's; per row its chunk
    ``sci``, payload bytes ``ssz`` and arena offset ``off``, -1 where none was reserved), the blocks its pieces
    hold as one slice of a block-major host view, when it has two pieces or more, all placed, of one size and
    evenly spaced, and its chunks, in order, hold consecutive blocks; else None (the group then moves a piece
    at a time). Found for every group at once: a row breaks its group's run where it does not follow the
    row before it. Chunks of different block counts are never one run: each piece holds its own chunk's blocks."""
    spans = [_run_of(ch.blocks) for ch in chunks]
    first = np.fromiter((-1 if r is None else r.start for r in spans), dtype=np.int64, count=len(spans))[sci]
    stop = np.fromiter((-1 if r is None else r.stop for r in spans), dtype=np.int64, count=len(spans))[sci]
    piece = -(-(ssz + HEADER_SIZE) // UNIT) * UNIT
    alone = (first < 0) | (off < 0)
    bad = alone.copy()
    bad[1:] |= (first[1:] != stop[:-1]) | (ssz[1:] != ssz[:-1]) | (off[1:] - off[:-1] != piece[1:])
    bad[starts] = alone[starts]  # a group's first row follows no row of its group
    ends = np.r_[starts[1:], len(sci)]
    whole = ((np.add.reduceat(bad, starts) == 0) & (ends - starts >= 2)).tolist()
    return [slice(int(first[a]), int(stop[b - 1])) if w else None
            for w, a, b in zip(whole, starts.tolist(), ends.tolist())]


def _template_rows(heads: Sequence[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Header templates (:meth:`~orbitkv_fs.manager.registry._Seg.raw_header` answers) as one array of rows
    and one of CRC bases: the rows joined as bytes (numpy's concatenate of structured rows promotes their
    fields one row at a time: 160 us for 16 rows, against 1.4)."""
    return (np.frombuffer(b"".join([h[0].tobytes() for h in heads]), dtype=HEADER_DTYPE),
            np.asarray([h[1] for h in heads], dtype=np.uint32))


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

    def _check_exact_bound(self, eng: _Engine, chunks: Sequence[ChunkBlocks], raw_on_host: bool) -> None:
        """A chunk whose exact segment of host pages (``raw_on_host``: exact segments take this path) would pass
        the segment format's bound: a :class:`RequestError` naming it, before the save reserves anything."""
        exact = [s.block_bytes for s in eng.segs if s.codec is None] if raw_on_host else []
        if not exact or not chunks:
            return
        most = max(exact)
        if max(map(len, map(_BLOCKS, chunks))) * most > MAX_STORED_BYTES:
            n = next(len(ch.blocks) for ch in chunks if len(ch.blocks) * most > MAX_STORED_BYTES)
            raise RequestError(f"chunk of {n} blocks makes a {n * most}-byte segment, over the "
                               f"{MAX_STORED_BYTES}-byte bound")

    def _save_raw_batch(self, eng: _Engine, rows: SaveRows, acc: _SaveAcc) -> None:
        """Save exact segments of host pages, ``rows`` (a batch of runs of chunks' segments, as a codec batch
        is): reserve every extent in one round, segment-major; per (layer, role), the pieces of chunks that hold
        consecutive blocks, laid evenly, move with one copy, the others a gather each, and each piece's payload
        CRC32C is taken right after, while its bytes are in cache; every header is written at once from its
        template row; one publish round in request order. Where the pieces lie, which groups move at once and
        which template each row takes are found as arrays over the batch. A segment that found no room goes to
        the lower tier (or is dropped), as one at a time."""
        c0 = time.thread_time()
        segs, chunks, ci, si = eng.segs, rows.chunks, rows.ci, rows.si
        k = len(si)
        nblk = np.fromiter(map(len, map(_BLOCKS, chunks)), dtype=np.int64, count=len(chunks))
        sizes = nblk[ci] * eng.block_bytes[si]  # payload bytes, request order
        # Segment-major: the pieces of one (layer, role) lie side by side in the batch's extent, so that a
        # group whose chunks hold consecutive blocks moves with one copy.
        order = np.argsort(si, kind="stable")
        sci, ssi, ssz = ci[order], si[order], sizes[order]
        offs = self.dram.reserve_many((ssz + HEADER_SIZE).tolist())
        placed = None not in offs
        off = np.asarray(offs if placed else [-1 if o is None else o for o in offs], dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, ssi[1:] != ssi[:-1]])
        ends = np.r_[starts[1:], k]
        tids, tmpl_rows, tmpl_bases = self._raw_templates(segs, starts, ends, ssi, ssz)
        pcrc = np.zeros(k, dtype=np.uint32)
        buf = self.dram.arena.buf
        sent = None  # the arena offsets handed to publish_many, once it is called
        done: list[bool] = []
        try:
            crc = _crc32c.crc32c
            runs = _group_runs(chunks, sci, ssz, off, starts)
            with memoryview(buf) as mv:
                for g, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
                    seg = segs[int(ssi[start])]
                    n = int(ssz[start])
                    run = runs[g]
                    if run is not None and type(seg.base) is np.ndarray:
                        # one copy for the group (at most a batch: it stays in cache), its CRCs right after
                        at = offs[start:end]
                        np.copyto(_payloads(buf, at[0], end - start, n, seg), _blocks(seg, run, end - start))
                        pcrc[start:end] = [crc(mv[o + HEADER_SIZE:o + HEADER_SIZE + n]) for o in at]
                        continue
                    for r in range(start, end):
                        o = offs[r]
                        if o is None:
                            continue
                        blocks = chunks[sci[r]].blocks
                        n = int(ssz[r])
                        p = o + HEADER_SIZE
                        seg.gather_into(blocks, buf[p:p + n].view(seg.dtype).reshape((len(blocks),) + seg.block_shape))
                        pcrc[r] = crc(mv[p:p + n])
            self._check_pages(eng)  # the pages shrank under the copies: they read zeros, which are not kept
            live = off >= 0
            if placed or live.any():
                tid = tids if placed else tids[live]
                crcs = pcrc if placed else pcrc[live]
                # the rows taken as 8 words each: numpy's take of structured rows copies field by field (40 us
                # for 512 rows, 2.5 as words)
                heads = np.take(tmpl_rows.view(np.uint64).reshape(-1, 8), tid, axis=0).view(HEADER_DTYPE).reshape(-1)
                heads["payload_crc"] = crcs
                heads["header_crc"] = header_crcs(tmpl_bases[tid], crcs)
                _put_headers(buf, offs if placed else off[live].tolist(),
                             ssz.tolist() if placed else ssz[live].tolist(), heads)
            # Request order (chunk-major; the copies went segment-major): the index places a chunk's new
            # segments in one step (ObjectIndex.add_many), where a run of one chunk takes its per-key path,
            # and the eviction policy ages chunks in publication order.
            back = np.empty(k, dtype=np.intp)
            back[order] = np.arange(k)
            req_off = off[back]
            if placed:
                at = np.arange(k)
                keys = rows.keys
                # keys made from checked chunk keys and the registration's tails: their scan is known
                runs_of = (eng.subs[si], rows.starts) if rows.starts is not None else None
            else:
                at = np.flatnonzero(req_off >= 0)
                keys = [rows.keys[j] for j in at.tolist()]
                runs_of = None
            c1 = time.thread_time()
            sent = req_off[at]
            pub_sizes = sizes[at]
            self.dram.publish_many(keys, sent, pub_sizes + HEADER_SIZE, pub_sizes,
                                   np.full(len(at), _RAW, dtype=np.int64), done, runs=runs_of)
        except BaseException:
            # What publish_many did not reach is still reserved; so is everything when it was not called.
            if sent is None:
                for o, n in zip(offs, ssz.tolist()):
                    if o is not None:
                        self.dram.cancel(o, n + HEADER_SIZE)
            else:
                for o, n in zip(sent[len(done):].tolist(), sizes[at][len(done):].tolist()):
                    self.dram.cancel(o, n + HEADER_SIZE)
            raise
        # Admissions per batch: the keys as one list, the byte sums, the raw reasons per segment class.
        if False in done:  # some keys were present already: their extents went back
            ok = np.fromiter(done, dtype=bool, count=len(done))
            keys, at, pub_sizes = list(compress(keys, done)), at[ok], pub_sizes[ok]
        published = len(at)
        acc.admit_batch(keys)
        logical = int(pub_sizes.sum())
        acc.logical += logical
        acc.stored += logical + HEADER_SIZE * published
        if published:
            self._count(self._codec_segments, "raw", published)
            per_seg = np.bincount(si[at], minlength=len(segs))
            reasons: collections.Counter[str] = collections.Counter()
            for s in np.flatnonzero(per_seg).tolist():
                if segs[s].raw_reason != RawReason.NONE:
                    reasons[segs[s].raw_reason.name.lower()] += int(per_seg[s])
            for name, n in reasons.items():
                acc.raw[name] = acc.raw.get(name, 0) + n
                self._count(self._raw, name, n)
        if not placed:  # no room in DRAM: one at a time, as before
            for r in np.flatnonzero(off < 0).tolist():
                ch, seg = chunks[sci[r]], segs[ssi[r]]
                blob = raw_segment(_gather_host(seg, ch.blocks), role=seg.role, layer=seg.layer, reason=seg.raw_reason)
                self._check_pages(eng)
                self._demote_direct(rows.keys[order[r]], blob, acc)
        c2 = time.thread_time()
        self._cpu("save_encode", c1 - c0, k)
        self._cpu("save_publish", c2 - c1, k)

    @staticmethod
    def _raw_templates(segs: Sequence[_Seg], starts: np.ndarray, ends: np.ndarray, ssi: np.ndarray,
                       ssz: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The raw header templates of a segment-major batch (segment indices ``ssi``, payload bytes ``ssz``;
        its groups of one segment ``starts[g] .. ends[g]``): each row's template index, the template rows
        and their CRC bases. A batch whose groups are each of one size (chunks of one block count) takes a
        template per group; another one per distinct (segment, size)."""
        lens = ends - starts
        if (ssz == np.repeat(ssz[starts], lens)).all():
            pairs = zip(ssi[starts].tolist(), ssz[starts].tolist())
            tids = np.repeat(np.arange(len(starts)), lens)
        else:
            uniq, tids = np.unique((ssi << 32) | ssz, return_inverse=True)
            pairs = ((u >> 32, u & 0xFFFFFFFF) for u in uniq.tolist())
        return (tids.reshape(-1),) + _template_rows([segs[s].raw_header(n) for s, n in pairs])

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
        rows, bases = _template_rows([s.raw_header(int(n)) for nb in sizes_of for s, n in zip(segs, sizes_of[nb])])
        rows = rows.view(np.uint8).reshape(-1, HEADER_SIZE)
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
