"""The SSD tier's read path: demand reads (host and device memory) and the speculative prefetch lane.

A mixin of :class:`~orbitkv_fs.tiers.ssd.tier.SsdTier` (it shares the tier's lock, counters, shards and
index). It owns the pool of demand-read rings (``_read_rings``), the demand count and hold-off
(``_demand``, ``_demand_until``: the writeback lane throttles on them), and the prefetch lane (``_pf_*``).

Primitives: :meth:`ReadPath.contains`, :meth:`ReadPath.read`, :meth:`ReadPath.read_many` (optionally
streaming to a sink), :meth:`ReadPath.describe`, :meth:`ReadPath.read_many_device` (the cuFile direct
path), :meth:`ReadPath.prefetch`; :func:`plan_reads`, the windows and extents of a host read (demand or
prefetch).

Invariants:

1. Every record read is checked before a byte of it is served: its header CRC, and against what the index
   holds of it key, generation, length, offset, the segment header (its CRC, length, and the payload
   CRC32C recorded when it was submitted or recovered), the payload CRC32C (device reads: on the GPU, by
   the consumer). The tag is recovery's: at run time the index says which record must be where.
2. A record that fails is a miss and only that generation leaves the index at once (counted as
   corrupt); its space is reclaimed when its leases drain. An I/O error is a miss that invalidates
   nothing (a failed read of several records is read again record by record), until a record's own
   demand reads failed :data:`UNREADABLE_AFTER` times in a row: then it leaves the index as a corrupt one.
3. A record is leased from the moment a read of it is prepared until that read is settled, so the ring
   never overwrites a record under a read; a read in flight keeps its buffer until the kernel is done.
4. Keys submitted and not yet written are served from the submitted bytes (the index's ``pending``).
5. The prefetch lane never delays demand reads: it starts no read while one is in progress.
6. A disk that stops answering costs a reader at most ``read_timeout`` once: a demand read that sees no
   completion for that long gives up (its records miss, reason ``timeout``; nothing is invalidated), its
   ring and buffers are set aside until the kernel is done with them (:class:`_Stuck`), and its shards are
   *stalled*: reads of their records miss at once (``read_stalled_total``) until those reads complete.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ...errors import SegmentError
from ...keys import ObjectKey
from ...segment import HEADER_SIZE
from .lane import io_reason, peek_segment
from .record import RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, record_length, verify_record, verify_record_head
from .ring import Slot
from .uring import IoRing, SsdIoError

log = logging.getLogger(__name__)


def _heads(arr: Any, offsets: list[int]) -> list[bytes]:
    """The first RECORD_HEAD_BYTES of the records at ``offsets`` of a numpy or CuPy array; for a device
    array, gathered by one kernel and copied to the host at once (not one small copy per record)."""
    if not offsets:
        return []
    if isinstance(arr, np.ndarray):
        return [arr[o:o + RECORD_HEAD_BYTES].tobytes() for o in offsets]
    import cupy

    idx = cupy.asarray(np.add.outer(np.asarray(offsets, dtype=np.int64), np.arange(RECORD_HEAD_BYTES)))
    host = arr[idx].get()
    return [row.tobytes() for row in host]


#: Bytes of records a demand read reads into one buffer (at least one record): records that lie end to end
#: on disk in it are read by one I/O.
READ_WINDOW = 2 << 20
#: Bytes of window buffers a demand read holds at most beyond its first two windows.
READ_AHEAD = 16 << 20
#: Demand reads of a record that failed in a row (I/O errors, not timeouts) after which it is dropped.
UNREADABLE_AFTER = 2
#: Records whose failed reads are remembered at most (a disk failing everywhere must not grow it unbounded).
_FAILURES_KEPT = 1 << 16


class ReadWindow:
    """The records a demand read reads into one buffer: ``records`` (index into the keys, position in the
    buffer, extent), ``extents`` (shard, disk offset, position in the buffer, length: one read each), the
    buffer once taken, and what each extent's read answered."""

    __slots__ = ("records", "extents", "nbytes", "buf", "results", "started", "took", "left")

    def __init__(self) -> None:
        self.records: list[tuple[int, int, int]] = []
        self.extents: list[list[int]] = []
        self.nbytes = 0
        self.buf: Any = None
        self.results: list[int] = []
        self.started: list[float] = []
        self.took: list[float] = []
        self.left = 0

    def landed(self, e: int, res: int, now: float) -> None:
        """Extent ``e``'s read ended with ``res`` (bytes read or -errno) at ``now``."""
        self.results[e] = res
        self.took[e] = now - self.started[e]
        self.left -= 1

    def split_failed(self, slots: "Sequence[Slot | None]") -> list[int]:
        """Give each record of an extent of several records whose read failed (an errno, or short of the
        record) an extent of its own, to be read again; answer those extents. A disk fails a whole request
        for one bad block: without this, one bad sector cost every record read beside it, at every read."""
        failed = {e for e, (_, _, _, length) in enumerate(self.extents) if self.results[e] < length}
        if not failed:  # the common case, checked first: every window of every read passes here
            return []
        records = collections.Counter(e for _, _, e in self.records if e in failed)
        redo = {e for e, n in records.items() if n > 1}
        if not redo:
            return []
        out = []
        for k, (i, pos, e) in enumerate(self.records):
            if e not in redo:
                continue
            s = slots[i]
            if self.results[e] >= 0 and pos + s.length <= self.extents[e][2] + self.results[e]:
                continue  # a short read that brought this record in whole
            self.extents.append([s.shard, s.offset, pos, s.length])
            self.records[k] = (i, pos, len(self.extents) - 1)
            out.append(len(self.extents) - 1)
        self.results += [0] * len(out)
        self.started += [0.0] * len(out)
        self.took += [0.0] * len(out)
        self.left += len(out)
        return out


def plan_reads(places: Sequence[tuple[int, int, int, int]], window: int, extents: int) -> list[ReadWindow]:
    """The windows of a demand read of records at ``places`` (index into the keys, shard, disk offset, record
    length), in disk order: each holds records up to ``window`` bytes (at least one), laid in its buffer in
    that order, and records that follow each other on disk in one shard form one extent (one read), up to
    ``extents`` extents a window. A record named twice gets two places."""
    out: list[ReadWindow] = []
    w: ReadWindow | None = None
    end = (-1, -1)  # (shard, disk offset) where the window's last extent ends
    for i, shard, offset, length in sorted(places, key=lambda p: (p[1], p[2], p[0])):
        joins = end == (shard, offset)
        if w is None or w.nbytes + length > window or (not joins and len(w.extents) == extents):
            w = ReadWindow()
            out.append(w)
            joins = False
        if joins:
            w.extents[-1][3] += length
        else:
            w.extents.append([shard, offset, w.nbytes, length])
        w.records.append((i, w.nbytes, len(w.extents) - 1))
        w.nbytes += length
        end = (shard, offset + length)
    for w in out:
        n = len(w.extents)
        w.results, w.started, w.took, w.left = [0] * n, [0.0] * n, [0.0] * n, n
    return out


def _window_segment(w: ReadWindow, pos: int, e: int, s: "Slot") -> "tuple[memoryview | None, str]":
    """The record of ``s`` at ``pos`` of landed window ``w`` (extent ``e``): its verified segment (a view of the
    window's buffer) and "", or None and why: the errno or short read of an extent that did not bring it in
    whole, or "corrupt" when it fails :func:`~.record.verify_record`. Demand reads and the prefetch lane alike."""
    res = w.results[e]
    if res < 0 or w.extents[e][2] + res < pos + s.length:
        return None, io_reason(res, "short_read")
    try:
        return verify_record(w.buf[pos:pos + s.length], s.offset, s.key.pack(), s.generation, s.stored, s.crc), ""
    except SegmentError:
        return None, "corrupt"


class _ReadStalled(Exception):
    """No read of a demand read completed within ``read_timeout``."""


class _Stuck:
    """A demand read given up on a stalled disk: its ring, the reads the kernel still holds (tag -> shard)
    and every buffer they may write into, kept until the last of them completes."""

    __slots__ = ("ring", "reads", "buffers", "since")

    def __init__(self, ring: IoRing, reads: dict[int, int], buffers: list) -> None:
        self.ring, self.reads, self.buffers, self.since = ring, reads, buffers, time.monotonic()


class ReadPath:
    """Mixin: the read half of :class:`~orbitkv_fs.tiers.ssd.tier.SsdTier` (see the module docstring)."""

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._index or key in self._index.pending

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """:meth:`contains` of each key under one hold of the tier's lock (a lookup asks for a chunk's
        segments at once)."""
        index, pending = self._index, self._index.pending
        with self._lock:
            return [k in index or k in pending for k in keys]

    def read(self, key: ObjectKey) -> bytes | None:
        """The validated segment bytes of ``key``, or None (absent, I/O error, or corrupt)."""
        return self.read_many([key])[0]

    def read_many(self, keys: Sequence[ObjectKey],
                  sink: "Callable[[int, bytes], None] | None" = None) -> list[bytes | None]:
        """Demand-read several keys at once.

        The records are read in windows (:func:`plan_reads`): each window's records into one buffer, records
        that lie end to end on disk by one read, up to the read queue depth in flight; the next window's
        reads are in flight while this thread checks the one that landed.

        With ``sink``, each segment is handed to ``sink(index, segment)`` as soon as it is validated and
        not kept in the returned list (which then holds None for it): a consumer that stores segments
        elsewhere (DRAM) never holds more than two windows, or :data:`READ_AHEAD` bytes of them. The
        segment is then a view valid during the call only (of the window's buffer, reused afterwards): copy
        what you keep."""
        begun = self._begin_reads(keys)
        if begun is None:
            return [None] * len(keys)
        slots, staged, ring, skip = begun
        out: list[bytes | None] = [None] * len(keys)
        verdicts: dict[int, str] = {}  # index -> why it is a miss: "corrupt" or the I/O error
        hits: set[int] = set()
        bufs: dict[int, tuple[ReadWindow, int]] = {}  # reads in flight: tag -> (window, extent)
        # A window of records apart on disk holds half a ring of reads: it is checked while the next one's
        # reads keep the ring busy.
        windows = plan_reads([(i, s.shard, s.offset, s.length) for i, s in enumerate(slots)
                              if s is not None and i not in skip],
                             READ_WINDOW, max(1, self.config.read_queue_depth // 2))
        held: list[ReadWindow] = []  # windows with a buffer, in order; the first is checked next
        queue: collections.deque[tuple[ReadWindow, int]] = collections.deque()  # (window, extent) to read
        broken = False  # the ring raised: reads may sit in it prepped, never submitted
        stuck: _Stuck | None = None  # the disk stopped answering
        try:
            # Inside the try: a sink that raises must still give back the leases and the demand count.
            for i, data in staged.items():
                if sink is None:
                    out[i] = data
                else:
                    sink(i, data)
            if windows and ring is None:
                ring = self._io.ring(self.config.read_queue_depth)
            nxt = tag = held_bytes = 0
            while nxt < len(windows) or held:
                # A window is taken once the reads of those before it are all prepped: while fewer than two
                # have buffers (the one to check next, and one whose reads go on meanwhile), or while the
                # ring has room and the buffers held stay within READ_AHEAD (records apart on disk: one read
                # each, as many in flight as the ring takes).
                while nxt < len(windows) and not queue and (
                        len(held) < 2 or (ring.space() > 0 and held_bytes + windows[nxt].nbytes <= READ_AHEAD)):
                    w = windows[nxt]
                    nxt += 1
                    w.buf = self._staging.host(w.nbytes)
                    held.append(w)
                    held_bytes += w.nbytes
                    queue.extend((w, e) for e in range(len(w.extents)))
                while queue and ring.space() > 0:
                    w, e = queue.popleft()
                    shard, offset, pos, length = w.extents[e]
                    tag += 1
                    bufs[tag] = (w, e)
                    w.started[e] = time.perf_counter()
                    ring.prep_read(self._shards[shard].fid, w.buf[pos:pos + length], offset, tag)
                if ring is not None and ring.unsent():
                    ring.submit()
                w = held[0]
                if w.left:
                    for t, res in self._wait_reads(ring):
                        done, e = bufs.pop(t)
                        done.landed(e, res, time.perf_counter())
                    continue
                again = w.split_failed(slots)
                if again:  # one unreadable block failed every record read with it: read those one by one
                    queue.extendleft((w, e) for e in reversed(again))
                    continue
                self._check_window(w, slots, out, verdicts, hits, sink)
                held.pop(0)
                held_bytes -= w.nbytes
                self._staging.recycle(w.buf)
        except SsdIoError:
            broken = True
            raise
        except _ReadStalled:
            stuck = _Stuck(ring, {t: w.extents[e][0] for t, (w, e) in bufs.items()}, [w.buf for w in held])
            bufs = {}
            self._give_up(slots, hits, verdicts, skip)
        finally:
            self._end_reads(ring, broken, bufs, len(keys), slots, hits, verdicts, stuck, skip)
            if not bufs and stuck is None:  # a buffer still in the kernel's hands is left alone
                for w in held:
                    self._staging.recycle(w.buf)
        return out

    def _wait_reads(self, ring: IoRing) -> list[tuple[int, int]]:
        """Submit what is prepped and wait for at least one completion, at most ``read_timeout`` seconds
        without one (:class:`_ReadStalled`)."""
        deadline = time.monotonic() + self.config.read_timeout
        while True:
            got = ring.submit_and_wait(max(0.0, deadline - time.monotonic()))
            if got:
                return got
            if time.monotonic() >= deadline:
                raise _ReadStalled()

    def _give_up(self, slots: "list[Slot | None]", hits: set[int], verdicts: dict[int, str], skip: set[int]) -> None:
        """A demand read stalled: each record it has not served or judged misses as ``timeout``."""
        for i, s in enumerate(slots):
            if s is not None and i not in hits and i not in verdicts and i not in skip:
                verdicts[i] = "timeout"

    def _check_window(self, w: "ReadWindow", slots: "list[Slot | None]", out: "list[bytes | None]",
                      verdicts: dict[int, str], hits: set[int],
                      sink: "Callable[[int, bytes], None] | None") -> None:
        """Check each record of a landed window (:func:`~.record.verify_record`) and serve it: into ``out``
        (a copy) or to ``sink`` (a view of the window's buffer). A record its extent's read did not cover
        (an errno, or a short read) is a miss with that reason; one that fails a check is "corrupt"."""
        for i, pos, e in w.records:
            seg, why = _window_segment(w, pos, e, slots[i])
            if seg is None:
                verdicts[i] = why
                continue
            self._read_lat.append(w.took[e])
            hits.add(i)
            if sink is None:
                out[i] = bytes(seg)
            else:
                sink(i, seg)

    def _begin_reads(self, keys: Sequence[ObjectKey]
                     ) -> "tuple[list[Slot | None], dict[int, bytes], IoRing | None] | None":
        """Start a demand read of ``keys``: the demand count goes up (writeback throttles, the prefetch
        lane waits), each published record gets a read lease. Answers the slots (None: not published),
        the bytes of keys submitted but not yet written (index -> segment) and a pooled read ring (None:
        make one) and the indices whose records lie on a stalled shard (leased, not to be read); None when
        the tier is closed. :meth:`_end_reads` undoes it all."""
        if self._stuck:
            self._reap_stuck()
        with self._lock:
            if self._closed:
                return None
            self._demand += 1
            slots: list[Slot | None] = []
            staged: dict[int, bytes] = {}  # submitted, write not completed: served from memory
            for i, k in enumerate(keys):
                p = self._index.pending.get(k)
                if p is not None:
                    # Copied under the lock: a pending segment lives in its write's staging buffer,
                    # which is recycled once the write ends.
                    staged[i] = bytes(p[1])
                    slots.append(None)
                    continue
                s = self._index.get(k)
                if s is not None:
                    s.leases += 1
                slots.append(s)
            self._c["read_pending_hits_total"] += len(staged)
            ring = self._read_rings.pop() if self._read_rings else None
            stalled = self._stalled
            skip = {i for i, s in enumerate(slots) if s is not None and s.shard in stalled} if stalled else set()
        return slots, staged, ring, skip

    def _reap_stuck(self) -> None:
        """Collect what the kernel finished of reads given up on (:class:`_Stuck`); a ring whose reads all
        ended goes back to the pool with its buffers, and shards none of them hold answer again. One thread
        at a time (a ring has one owner); others go on."""
        if not self._stuck_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                stuck = list(self._stuck)
            for st in stuck:
                for t, _ in st.ring.reap():
                    st.reads.pop(t, None)
                if st.reads:
                    continue
                with self._lock:
                    self._stuck.remove(st)
                    self._stalled = {sh for other in self._stuck for sh in other.reads.values()}
                    if self._closed:
                        st.ring.close()
                    else:
                        self._read_rings.append(st.ring)
                for b in st.buffers:
                    self._staging.recycle(b)
                log.warning("SSD: the reads given up on %.1f s ago completed; its shards are read again",
                            time.monotonic() - st.since)
        finally:
            self._stuck_lock.release()

    def _end_reads(self, ring: "IoRing | None", broken: bool, bufs: dict, nkeys: int,
                   slots: "list[Slot | None]", hits: set[int], verdicts: dict[int, str],
                   stuck: "_Stuck | None" = None, skip: "set[int] | None" = None) -> None:
        """End a demand read begun by :meth:`_begin_reads`: wait for reads still in flight (``bufs``:
        index -> buffer), give the ring back, count, and settle every leased slot (``hits``: served;
        ``verdicts``: index -> why it missed). A read that stalled (``stuck``) waits for nothing: its ring
        and buffers are set aside and its shards stalled; ``skip``: records not read, their shard stalled."""
        if stuck is not None:
            ring = None
        # Interrupted (a sink raised, the ring failed): the kernel may still write into buffers of
        # reads in flight, and their completions must not reach the ring's next user. A ring that
        # failed to submit is closed instead (close waits for what the kernel got; reads it never got
        # would never complete, and the next user's submit would send them): it is not reused.
        if broken and ring is not None:
            ring.close()
            ring = None
        while bufs and ring is not None:
            for i, _ in ring.wait(1.0):
                bufs.pop(i, None)
        with self._lock:
            if ring is not None and self._closed:
                ring.close()
            elif ring is not None:
                self._read_rings.append(ring)
            if stuck is not None:
                self._stuck.append(stuck)
                self._stalled = self._stalled | set(stuck.reads.values())
                log.warning("SSD: no read completed within %.1f s on shard(s) %s: reads of them miss until the "
                            "disk answers", self.config.read_timeout,
                            ", ".join(self._shards[i].path for i in sorted(set(stuck.reads.values()))))
            self._c["read_stalled_total"] += len(skip or ())
            self._c["read_total"] += nkeys
            self._demand -= 1
            self._demand_until = time.perf_counter() + self.config.demand_holdoff
            if not self._demand:
                self._pf_cond.notify_all()
            for i, s in enumerate(slots):
                if s is None:
                    continue
                if i in hits:
                    self._c["read_hits_total"] += 1
                    self._c["read_bytes_total"] += s.length
                    if self._read_failures:
                        self._read_failures.pop(s, None)
                self._settle_read(s, verdicts.get(i, ""), "read_errors_total")

    def describe(self, keys: Sequence[ObjectKey]) -> "list[tuple[int, int] | None]":
        """``(original length, segment length)`` of each key's readable object (published or pending),
        None when absent: what a caller needs to size destinations and bound a :meth:`read_many_device`
        window before reading anything."""
        out: list[tuple[int, int] | None] = []
        with self._lock:
            for k in keys:
                p = self._index.pending.get(k)
                if p is not None:
                    _, original, stored, _ = peek_segment(p[1])
                    out.append((original, HEADER_SIZE + stored))
                    continue
                s = self._index.get(k)
                out.append(None if s is None else (s.original, s.stored))
        return out

    def read_many_device(self, keys: Sequence[ObjectKey],
                         sink: "Callable[[list[tuple[int, Any]]], Iterable[int] | None]", *,
                         max_bytes: int = 64 << 20) -> "list[str | None]":
        """Demand-read ``keys`` into device memory (cuFile backend; host staging on other backends, for
        tests) and hand their segments on without a host bounce.

        Records are read in windows of at most ``max_bytes`` of record bytes (at least one record), into
        one block-aligned buffer reused from window to window. Of each record only its first
        :data:`~orbitkv_fs.tiers.ssd.record.RECORD_HEAD_BYTES` bytes go to the host, where the record
        header (CRC, key, generation, length) and the segment header (CRC, length) are checked like a
        demand read's. The segments that pass go to ``sink([(index, segment), ...])`` once per window, as
        1-D uint8 views (64-byte segment header + payload) of that window's buffer: they are valid only
        until the sink returns. The payload CRC32C is not checked here: the sink (the GPU codec engine's
        decode) checks it, and returns the indices whose payload failed; those records are corrupt.
        Keys submitted but not yet written are served from their submitted bytes, copied into the window.

        The corruption rules are the demand read's: a record that fails any check (here or in the sink)
        is a miss and only that generation is invalidated; an I/O error is a miss that invalidates
        nothing. Each record stays leased until its window's sink returned. Answers, per key, None when
        its segment went to the sink and was accepted, else why not: ``"absent"``, ``"corrupt"``, or the
        I/O error (``EIO``, ``short_read``...)."""
        begun = self._begin_reads(keys)
        if begun is None:
            return ["absent"] * len(keys)
        slots, staged, ring, skip = begun
        on_device = self.device_io
        result: list[str | None] = ["absent"] * len(keys)
        verdicts: dict[int, str] = {}
        hits: set[int] = set()
        bufs: dict[int, Any] = {}  # reads in flight
        broken = False
        stuck: _Stuck | None = None
        window_buf: Any = None
        try:
            todo = [(i, s.length if s is not None else record_length(len(staged[i])))
                    for i, s in enumerate(slots) if (s is not None and i not in skip) or i in staged]
            windows: list[list[tuple[int, int]]] = []
            size = 0
            for i, n in todo:
                if not windows or size + n > max_bytes:
                    windows.append([])
                    size = 0
                windows[-1].append((i, n))
                size += n
            if not windows:
                return result
            if ring is None:
                ring = self._io.ring(self.config.read_queue_depth)
            cap = max(sum(n for _, n in w) for w in windows)
            window_buf, arr = self._staging.record_buffer(cap, on_device=on_device)
            for window in windows:
                offs: dict[int, int] = {}
                pos = 0
                for i, n in window:
                    offs[i] = pos
                    pos += n
                started = time.perf_counter()
                # Submitted, not yet written: their bytes go where a record's segment would be.
                for i, _ in window:
                    if i in staged:
                        seg = np.frombuffer(staged[i], dtype=np.uint8)
                        dst = arr[offs[i] + RECORD_HEADER_SIZE:offs[i] + RECORD_HEADER_SIZE + seg.size]
                        if on_device:
                            dst.set(seg)
                        else:
                            dst[:] = seg
                reads = [i for i, _ in window if slots[i] is not None]
                landed: dict[int, int] = {}
                k = 0
                while k < len(reads) or bufs:
                    while k < len(reads) and ring.space() > 0:
                        i = reads[k]
                        s = slots[i]
                        view = arr[offs[i]:offs[i] + s.length]
                        bufs[i] = view
                        ring.prep_read(self._shards[s.shard].fid,
                                       view if on_device else window_buf[offs[i]:offs[i] + s.length],
                                       s.offset, i)
                        k += 1
                    for i, res in self._wait_reads(ring):
                        bufs.pop(i, None)
                        landed[i] = res
                ok = [i for i in reads if landed[i] == slots[i].length]
                for i in reads:
                    if landed[i] != slots[i].length:
                        verdicts[i] = io_reason(landed[i], "short_read")
                heads = _heads(arr, [offs[i] for i in ok])
                deliver: list[tuple[int, Any]] = []
                for i, head in zip(ok, heads):
                    s = slots[i]
                    try:
                        verify_record_head(head, s.offset, s.key.pack(), s.generation, s.stored, s.crc)
                    except SegmentError:
                        verdicts[i] = "corrupt"
                        continue
                    deliver.append((i, arr[offs[i] + RECORD_HEADER_SIZE:offs[i] + RECORD_HEADER_SIZE + s.stored]))
                for i, _ in window:
                    if i in staged:
                        n = len(staged[i])
                        deliver.append((i, arr[offs[i] + RECORD_HEADER_SIZE:offs[i] + RECORD_HEADER_SIZE + n]))
                deliver.sort()
                rejected = set(sink(deliver) or ()) if deliver else set()
                now = time.perf_counter()
                for i, _ in deliver:
                    if i in rejected:
                        verdicts[i] = "corrupt"
                        continue
                    hits.add(i)
                    if slots[i] is not None:
                        self._read_lat.append(now - started)
        except SsdIoError:
            broken = True
            raise
        except _ReadStalled:
            stuck = _Stuck(ring, {i: slots[i].shard for i in bufs}, [window_buf])
            bufs = {}
            self._give_up(slots, hits, verdicts, skip)
        finally:
            self._end_reads(ring, broken, bufs, len(keys), slots, hits, verdicts, stuck, skip)
            if window_buf is not None and not bufs and stuck is None:  # still in the kernel's hands: left alone
                self._staging.recycle(window_buf)
            with self._lock:
                for i in hits:
                    self._c["read_device_total"] += 1
                    s = slots[i]
                    self._c["read_device_bytes_total"] += s.length if s is not None else len(staged[i])
                # Pending bytes that failed downstream are not a record: nothing to invalidate, but the
                # tier's corruption count says so.
                self._c["corrupt_records_total"] += sum(1 for i in staged if verdicts.get(i) == "corrupt")
        for i in range(len(keys)):
            if i in hits:
                result[i] = None
            elif i in verdicts:
                result[i] = verdicts[i]
            elif i in skip:
                result[i] = "stalled"
        return result

    def _settle_read(self, s: "Slot", why: str, errors_counter: str) -> None:
        """A read of ``s`` ended (``why``: "" when it served or never ran): its lease goes, a corrupt
        record dies, an I/O error is counted under ``errors_counter``. A demand read's error is the
        record's own (a failed read of several records was read again record by record): a record whose
        reads failed :data:`UNREADABLE_AFTER` times in a row is dropped, as a corrupt one is (a failing
        block is tried again at every read otherwise, and a drive may take seconds over each try); a
        timeout is the disk's, not the record's, and drops nothing. Lock held."""
        s.leases -= 1
        if why == "corrupt":
            self._c["corrupt_records_total"] += 1
            self._index.kill(s)
        elif why:
            self._c[errors_counter] += 1
            self._errnos[why] += 1
            if errors_counter == "read_errors_total" and why != "timeout":
                failed = self._read_failures.pop(s, 0) + 1
                if failed >= UNREADABLE_AFTER:
                    self._c["unreadable_records_dropped_total"] += 1
                    self._index.kill(s)
                elif len(self._read_failures) < _FAILURES_KEPT:
                    self._read_failures[s] = failed

    def prefetch(self, keys: Sequence[ObjectKey], sink: Callable[[ObjectKey, memoryview], None], *,
                 max_bytes: int | None = None) -> int:
        """Queue speculative reads of ``keys`` on the background lane; answer how many were queued.

        Each record that validates (the demand-read checks) is handed to ``sink(key, segment)`` on the
        lane's thread, the segment a view valid during the call only (of the lane's window buffer, reused
        afterwards: copy what you keep, as with :meth:`read_many`'s sink); an absent key is skipped, a corrupt
        record is invalidated and dropped like a demand miss, an I/O error drops the key. Never waits for
        I/O, and never delays demand reads: the lane starts no read while a demand read is in progress. Keys
        already queued, not published yet (their bytes are still in memory), or over ``max_bytes`` of records
        for this call or the lane's ``prefetch_max_bytes`` (counted as dropped) are skipped."""
        limit = self.config.prefetch_max_bytes
        budget = limit if max_bytes is None else min(max_bytes, limit)
        n = 0
        with self._lock:
            if self._closed or limit <= 0:
                return 0
            for k in keys:
                s = self._index.get(k)
                if s is None or k in self._pf_keys:
                    continue
                if s.length > budget or self._pf_bytes + s.length > limit:
                    self._c["prefetch_dropped_total"] += 1
                    continue
                budget -= s.length
                self._pf_keys.add(k)
                self._pf_bytes += s.length
                self._pf_queue.append((k, s.length, sink))
                n += 1
            if n:
                self._c["prefetch_requested_total"] += n
                if self._pf_thread is None:
                    self._pf_thread = threading.Thread(target=self._prefetch_lane, name="orbitkv-ssd-prefetch",
                                                       daemon=True)
                    self._pf_thread.start()
                self._pf_cond.notify_all()
        return n

    def _serve_prefetched(self, w: ReadWindow, reqs: list) -> None:
        """Check each record of a landed prefetch window (the demand read's checks) and hand each verified
        segment (a view of the window's buffer) to its request's sink, then settle them all under one hold of
        the lock. The window's buffer goes back to the pool."""
        verdicts: list[str] = []
        for j, pos, e in w.records:
            k, _, sink, s = reqs[j]
            seg, why = _window_segment(w, pos, e, s)
            verdicts.append(why)
            if seg is None:
                continue
            try:
                sink(k, seg)
            except Exception:  # the consumer's failure must not stop the lane
                log.exception("SSD prefetch sink failed for %s", k)
        self._staging.recycle(w.buf)
        with self._lock:
            for (j, _, _), verdict in zip(w.records, verdicts):
                k, length, _, s = reqs[j]
                self._pf_keys.discard(k)
                self._pf_bytes -= length
                if not verdict:
                    self._c["prefetch_read_total"] += 1
                    self._c["prefetch_read_bytes_total"] += s.stored
                self._settle_read(s, verdict, "prefetch_errors_total")

    def _take_prefetch_window(self, room: int) -> "tuple[list, int]":
        """The queued requests of the prefetch lane's next window, leased, and the reads they take: records up
        to :data:`READ_WINDOW` bytes (at least one) in at most ``room`` reads. A record that starts where the
        last one taken of its shard ended joins its read (laid in disk order, as :func:`plan_reads` lays them,
        they make as many reads or fewer). Requests whose record is gone are dropped. Lock held."""
        reqs: list[tuple[ObjectKey, int, Callable[[ObjectKey, memoryview], None], Slot]] = []
        size = extents = 0
        ends: dict[int, int] = {}  # shard -> where the last record taken of it ends
        while self._pf_queue and (not reqs or size + self._pf_queue[0][1] <= READ_WINDOW):
            k, length, sink = self._pf_queue[0]
            s = self._index.get(k)
            if s is None:  # evicted, invalidated or replaced since it was queued
                self._pf_queue.popleft()
                self._pf_keys.discard(k)
                self._pf_bytes -= length
                self._c["prefetch_dropped_total"] += 1
                continue
            joins = ends.get(s.shard) == s.offset
            if not joins and extents == room:
                break
            self._pf_queue.popleft()
            s.leases += 1
            reqs.append((k, length, sink, s))
            size += s.length
            extents += not joins
            ends[s.shard] = s.offset + s.length
        return reqs, extents

    def _prefetch_lane(self) -> None:
        """The lane's thread: its own ring (prefetch_queue_depth), reads started only while no demand read
        is in progress, validated like demand reads, results to each request's sink. Queued keys go out in
        windows (:func:`plan_reads`: up to :data:`READ_WINDOW` bytes into one buffer, records end to end on
        disk by one read); a window is checked once all its reads landed. An I/O engine failure (the ring
        cannot be made or submitted to) ends the lane: its requests are dropped, their leases given back,
        and the next :meth:`prefetch` starts a new lane."""
        ring: IoRing | None = None
        inflight: dict[int, tuple[ReadWindow, int]] = {}  # tag -> (window, extent)
        windows: list[tuple[ReadWindow, list]] = []  # windows with reads in flight, and their requests
        taken: list[list] = []  # requests of windows taken, not yet prepped
        tag = 0
        try:
            ring = self._io.ring(self.config.prefetch_queue_depth)
            while True:
                with self._lock:
                    while not windows and not self._closed and (not self._pf_queue or self._demand):
                        self._pf_cond.wait(0.5)
                    if self._closed:  # queued requests go; reads in flight are waited for below
                        for k, length, _ in self._pf_queue:
                            self._pf_keys.discard(k)
                            self._pf_bytes -= length
                        self._pf_queue.clear()
                        if not windows:
                            return
                    room = ring.space()
                    while room and not self._demand and self._pf_queue:
                        reqs, extents = self._take_prefetch_window(room)
                        if not reqs:
                            break
                        taken.append(reqs)
                        room -= extents
                while taken:
                    reqs = taken[0]
                    for w in plan_reads([(j, r[3].shard, r[3].offset, r[3].length) for j, r in enumerate(reqs)],
                                        READ_WINDOW, len(reqs)):  # one window: its bytes and extents were counted
                        w.buf = self._staging.host(w.nbytes)
                        windows.append((w, reqs))
                        for e, (shard, offset, pos, length) in enumerate(w.extents):
                            tag += 1
                            inflight[tag] = (w, e)
                            w.started[e] = time.perf_counter()
                            ring.prep_read(self._shards[shard].fid, w.buf[pos:pos + length], offset, tag)
                    taken.pop(0)
                if ring.unsent():
                    ring.submit()
                for t, res in ring.wait(0.05) if inflight else ():
                    w, e = inflight.pop(t)
                    w.landed(e, res, time.perf_counter())
                while windows and not windows[0][0].left:
                    self._serve_prefetched(*windows.pop(0))
        except SsdIoError as e:
            log.warning("SSD prefetch lane stopped: %s", e)
        finally:
            # Reads still in flight finish before their buffers and leases go (close waits for them);
            # prepped but never submitted ones die with the ring.
            if ring is not None:
                ring.close()
            with self._lock:
                left = [(rs[j][0], rs[j][1], rs[j][3]) for w, rs in windows for j, _, _ in w.records]
                left += [(k, length, s) for reqs in taken for k, length, _, s in reqs]
                for k, length, s in left:
                    s.leases -= 1
                left_keys = [(k, length) for k, length, _ in left]
                left_keys += [(k, length) for k, length, _ in self._pf_queue]
                for k, length in left_keys:
                    self._pf_keys.discard(k)
                    self._pf_bytes -= length
                self._c["prefetch_errors_total"] += len(left)
                self._c["prefetch_dropped_total"] += len(self._pf_queue)
                self._pf_queue.clear()
                if self._pf_thread is threading.current_thread():
                    self._pf_thread = None
