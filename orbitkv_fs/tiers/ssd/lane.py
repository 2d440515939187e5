"""The SSD tier's writeback lane: staging a record, giving it ring space, a generation and its place in the
shard's log, and driving the io_uring writeback ring until its write completed and it is published.

A mixin of :class:`~orbitkv_fs.tiers.ssd.tier.SsdTier` (it shares the tier's lock, counters, shards and
index). It owns the write queue (``_queue``), the writes in flight (``_inflight``, ``_inflight_bytes``),
the staged-bytes gauge (``_pending_bytes``, ``_writing``), the writeback ring (``_wring``) and its thread.

Primitives: :meth:`WritebackLane.submit` (host bytes), :meth:`WritebackLane.submit_many` (a batch of them,
read during the call only: DRAM's eviction), :meth:`WritebackLane.submit_device` (device memory, the cuFile
direct path), :meth:`WritebackLane.flush`; for the tier: ``_place`` (ring space and a generation for a
record), ``_place_run`` (for a batch's records of one shard, end to end from one search), ``_start_record``
(the record's header and tag, its link in the log, its write queued), ``_queue_write``, ``_start``.

Invariants:

1. Two-phase publish: a record is WRITING from allocation until its write completed in full; only then is
   it COMMITTED and in the index (replacing the key's older record). A write invalidated meanwhile is
   never published.
2. The lane is bounded in queue depth and staged bytes; beyond that, a submit drops (counted). Demand
   reads never queue behind it (they use their own rings); while one is in progress, and for
   ``demand_holdoff`` after, the lane keeps at most ``write_bytes_while_reading`` bytes in flight.
3. A record's header is made under the tier's lock in the same hold as its allocation, so records link to
   each other in allocation (= generation) order, and the tag covers the body already staged.
4. Generations never pass :data:`~orbitkv_fs.tiers.ssd.record.GEN_MAX`: then writes are refused
   (:class:`GenerationsExhausted`, counted), never wrapped.
5. Every write that ends (completed, failed, cancelled) settles its place in the log, so the durable
   front a checkpoint records moves on.
6. A submitted segment is copied once, into its record's staging buffer, before :meth:`submit_many`
   returns; the key's pending segment is a view of that buffer, which is recycled only when the write
   ends, under the lock that also drops the pending entry: readers copy it under that lock.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...errors import SegmentError
from ...keys import ObjectKey
from ...segment import HEADER_SIZE, MAGIC, Format, crc32c, parse_header
from .record import (GEN_MAX, RECORD_HEADER_SIZE, Kind, pack_record_header_into, put_record_header, record_header,
                     record_length, write_record_body, lay_record_body)
from .ring import Shard, Slot
from .uring import SsdIoError

log = logging.getLogger(__name__)

#: Seconds after a bulk submitter last drove the writeback ring during which the lane's thread leaves
#: completions to it (see ``_writeback``).
_BULK_QUIET = 0.002
#: Writes per io_uring_enter next to a bulk submitter once that many are in flight.
_SUBMIT_BATCH = 4


class GenerationsExhausted(SsdIoError):
    """The tier's generation space is used up: it refuses writes (never wraps a generation)."""


@dataclass(slots=True)
class _Write:
    tag: int
    slot: Slot
    buf: Any
    started: float = 0.0
    held: bool = False  # held back at least once for demand reads (counted once)


# Fields of the segment header a submit needs (docs/format.md): format @6, original and stored length @16,
# payload CRC32C @24.
_SEG_FIELDS = struct.Struct("<4s2xB9xIII")
_FORMATS = {int(f): f for f in Format}


def peek_segment(segment: "bytes | memoryview") -> tuple[Format, int, int, int]:
    """Format, original and stored length, payload CRC32C of a segment the caller vouches for (the Manager
    admits only CRC-valid segments). Checks the magic and the header CRC, so a wrong buffer is a typed
    error; the full validation, payload CRC included, happens on every read. A fraction of
    :func:`parse_header`'s cost, which matters on the submit path of small records."""
    if len(segment) < HEADER_SIZE:
        raise SegmentError(f"{len(segment)} bytes cannot hold a segment header")
    head = bytes(segment[:HEADER_SIZE])
    magic, fmt, original, stored, pcrc = _SEG_FIELDS.unpack_from(head)
    if magic != MAGIC or crc32c(head[:60]) != int.from_bytes(head[60:], "little") or fmt not in _FORMATS:
        parse_header(head)  # raises the precise typed error
        raise SegmentError("segment header does not validate")
    return _FORMATS[fmt], original, stored, pcrc


def _segment_fields(segment: "bytes | memoryview") -> tuple[Format, int, int, int]:
    """Format, original length, segment length and payload CRC32C of a segment: :func:`peek_segment`, and its
    length checked against its header (``SegmentError``)."""
    fmt, original, stored, pcrc = peek_segment(segment)
    seg_len = HEADER_SIZE + stored
    if len(segment) != seg_len:
        raise SegmentError(f"segment of {len(segment)} bytes, its header says {seg_len}")
    return fmt, original, seg_len, pcrc


def io_reason(res: int, short: str) -> str:
    """The counter label of a failed I/O: the errno name (EIO, ENOSPC...) or ``short``."""
    return errno.errorcode.get(-res, f"errno_{-res}") if res < 0 else short


def _host_bytes(a: Any) -> bytes:
    """The bytes of a small numpy or CuPy array (a device array is copied to the host)."""
    return a.tobytes() if isinstance(a, np.ndarray) else a.get().tobytes()


def _sync(a: Any) -> None:
    """Wait for the device work queued on the current stream (a device ``a``); nothing for numpy."""
    if not isinstance(a, np.ndarray):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class WritebackLane:
    """Mixin: the writeback half of :class:`~orbitkv_fs.tiers.ssd.tier.SsdTier` (see the module docstring)."""

    def submit(self, key: ObjectKey, segment: "bytes | memoryview", *, timeout: float = 0.0) -> bool:
        """Queue ``segment`` for writeback (copied into an aligned staging buffer). False when dropped:
        the tier is closed, the lane is full, no ring space can be found, or the generation space is used
        up. By default it never waits and leaves the submission to the lane's thread; with ``timeout``
        (callers that demote in bulk, such as a DRAM flush) it waits up to that many seconds for room in
        the lane and submits the write itself. A segment already on disk as ``key``'s published record
        (same length, format and payload CRC32C: DRAM evicting a copy it read back from here, or one
        :meth:`submit_device` wrote) is not written again (True, ``write_already_stored_total``). Raises
        ``SegmentError`` when ``segment`` is not a segment."""
        return self.submit_many((key,), (segment,), timeout=timeout) == 1

    def submit_many(self, keys: Sequence[ObjectKey], segments: Sequence["bytes | memoryview"], *,
                    timeout: float = 0.0) -> int:
        """:meth:`submit` of each ``(key, segment)`` in order, as one step; how many were taken (queued, or
        on disk already). A segment is read during the call only (DRAM's eviction hands views of extents
        it frees right after): it is copied once, into its staging buffer, and a read of the key before
        its write lands is served a copy of that buffer's segment. Every segment is checked before any
        is staged (``SegmentError``: none was taken). Without ``timeout`` (eviction, under DRAM's lock)
        the records are placed under one hold of the tier's lock and the lane's thread is woken once; a
        record the lane has no room for is dropped before its copy. With ``timeout`` each record waits
        for room and is started in turn, as :meth:`submit`."""
        heads = [_segment_fields(s) for s in segments]  # all checked before anything is staged
        todo: list[tuple] = []
        taken = dropped = planned = 0
        room = self.config.max_pending_bytes - self._pending_bytes  # an unlocked peek, rechecked in _place
        for key, segment, (fmt, original, seg_len, pcrc) in zip(keys, segments, heads):
            if self._already_stored(key, seg_len, fmt, original, pcrc):
                taken += 1
                continue
            rec_len = record_length(seg_len)
            if timeout <= 0 and planned + rec_len > room:
                dropped += 1  # the lane is full: drop before paying for the copy
                continue
            planned += rec_len
            todo.append((key, segment, rec_len, seg_len, fmt, original, pcrc))
        # The copies into the staging buffers run before any lock; the headers wait for the places.
        staged: list[tuple] = []
        for (key, segment, rec_len, seg_len, fmt, original, pcrc), buf in zip(
                todo, self._staging.host_many([t[2] for t in todo])):
            write_record_body(buf, segment)
            staged.append((key, key.pack(), rec_len, seg_len, fmt, original, pcrc, buf))
        if dropped:
            with self._lock:
                self._c["write_dropped_total"] += dropped
        if timeout > 0:
            for s in staged:
                with self._lock:
                    queued = self._enqueue(*s, timeout)
                if queued:
                    taken += 1
                    self._start(timeout)
        elif staged:
            with self._lock:
                queued = self._enqueue_many(staged)
            if queued:
                taken += queued
                self._start(0.0)
        return taken

    def _enqueue(self, key: ObjectKey, packed: bytes, rec_len: int, seg_len: int, fmt: Format, original: int,
                 pcrc: int, buf: memoryview, timeout: float) -> bool:
        """Give a staged record its place, header and link in the log, make its segment the key's pending
        bytes and queue its write; False when :meth:`_place` dropped it. Lock held."""
        slot = self._place(self._shard_of_packed(packed), key, rec_len, seg_len, fmt, original, pcrc, buf, timeout)
        if slot is None:
            return False
        self._start_record(slot, packed, seg_len, buf)
        return True

    def _enqueue_many(self, staged: Sequence[tuple]) -> int:
        """:meth:`_enqueue` of each staged record (``(key, packed, rec_len, seg_len, fmt, original, pcrc,
        buf)``, no waiting), a shard's records placed end to end at one place found for all of them where
        the lane and the ring have room for them at once (:meth:`_place_run`), else one by one. How many
        were queued. Lock held."""
        groups: dict[int, list[tuple]] = {}
        for r in staged:
            groups.setdefault(self._shard_of_packed(r[1]).index, []).append(r)
        queued = 0
        for si, recs in groups.items():
            slots = self._place_run(self._shards[si], recs) if len(recs) > 1 else None
            if slots is None:
                queued += sum(self._enqueue(*r, 0.0) for r in recs)
                continue
            for slot, (_, packed, _, seg_len, _, _, _, buf) in zip(slots, recs):
                self._start_record(slot, packed, seg_len, buf)
            queued += len(recs)
        return queued

    def _start_record(self, slot: Slot, packed: bytes, seg_len: int, buf: memoryview) -> None:
        """A placed record's header (its link: the chain's tail), its segment as the key's pending bytes, its
        write queued. Lock held."""
        sh = self._shards[slot.shard]
        sh.append(slot, pack_record_header_into(buf, sh.key, Kind.SEGMENT, packed, slot.generation, seg_len,
                                                slot.offset, *sh.link()))
        # The staging buffer holds the segment until the write ends (readers copy it under the lock).
        self._index.pending[slot.key] = (slot.generation, buf[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + seg_len])
        self._queue_write(slot, buf)

    def _place_run(self, sh: Shard, recs: Sequence[tuple]) -> "list[Slot] | None":
        """WRITING slots for records staged for ``sh`` (as :meth:`_enqueue_many` takes them), end to end from
        one place the ring's search found for all of them (one search, not one a record), generations in
        their order; None, with nothing changed, when the tier is closing, the lane has no room for all of
        them at once, the generations would run out, or the ring has no run that long. Lock held."""
        total = sum(r[2] for r in recs)
        if (self._closed or self._generation + len(recs) - 1 > GEN_MAX
                or self._pending_bytes + total > self.config.max_pending_bytes):
            return None
        pos = self._allocate(sh, total)
        if pos is None:
            return None
        slots = []
        for key, _, rec_len, seg_len, fmt, original, pcrc, _ in recs:
            slot = Slot(sh.index, pos, rec_len, key, self._generation, seg_len, fmt, original, pcrc)
            self._generation += 1
            sh.insert(slot)
            slots.append(slot)
            pos += rec_len
        self._writing += total
        self._pending_bytes += total
        return slots

    def _already_stored(self, key: ObjectKey, seg_len: int, fmt: Format, original: int, pcrc: int) -> bool:
        """True (counted) when the key's published record holds a segment with these header fields and no
        newer submit is pending: its bytes are on disk already. Without this, every chunk a lookup
        promoted from here was written again when DRAM evicted it (the H200 cohort's ``ssd/none`` run read
        11.9 GB back and wrote 32.9 GB in its minute, beside its demand reads)."""
        if key not in self._index:  # an unlocked peek first: the common case is a new key
            return False
        with self._lock:
            s = self._index.get(key)
            same = (s is not None and s.stored == seg_len and s.format == fmt and s.original == original
                    and s.crc == pcrc and key not in self._index.pending and not self._closed)
            if same:
                self._c["write_already_stored_total"] += 1
            return same

    def _place(self, sh: Shard, key: ObjectKey | None, rec_len: int, body_len: int, fmt: Format | None,
               original: int, pcrc: int, buf: Any, timeout: float) -> Slot | None:
        """Ring space in ``sh`` and a generation for a record of ``rec_len`` bytes staged in ``buf``: a
        WRITING slot, counted as writing and pending (the caller makes its header and appends it to the
        log in the same lock hold). Waits up to ``timeout`` for room; None (counted, ``buf`` recycled) when
        closed, no room, or no generation is left. Lock held."""
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                self._staging.recycle(buf)
                return None
            if self._generation > GEN_MAX:
                self._c["write_generations_exhausted_total"] += 1
                self._staging.recycle(buf)
                if not self._exhausted_logged:
                    self._exhausted_logged = True
                    log.error("%s", GenerationsExhausted(f"SSD tier generations used up (> {GEN_MAX}): writes refused"))
                return None
            offset = None
            if self._pending_bytes + rec_len <= self.config.max_pending_bytes:
                offset = self._allocate(sh, rec_len)
            if offset is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not (self._queue or self._inflight):  # nothing in flight will make room
                self._c["write_dropped_total"] += 1
                self._staging.recycle(buf)
                return None
            self._idle.wait(left)
        gen = self._generation
        self._generation += 1
        slot = Slot(sh.index, offset, rec_len, key, gen, body_len, fmt, original, pcrc)
        sh.insert(slot)
        self._writing += rec_len
        self._pending_bytes += rec_len
        return slot

    def _allocate(self, sh: Shard, length: int) -> int | None:
        """``length`` bytes at or after ``sh``'s ring head, evicting unleased records. Lock held."""
        found = sh.find_room(length)
        if found is None:
            return None
        pos, victims, skips = found
        self._c["write_skipped_blocked_total"] += skips
        for s in victims:
            if self._index.release(s):
                self._c["evicted_total"] += 1
                self._c["evicted_bytes_total"] += s.stored
            sh.remove(s)
        sh.head = pos + length
        return pos

    def _queue_write(self, slot: Slot, buf: Any) -> None:
        self._queue.append(_Write(slot.generation, slot, buf))
        self._c["write_submitted_total"] += 1

    def _start(self, timeout: float) -> None:
        """Get a queued write going (see :meth:`submit`)."""
        if timeout > 0:
            # A bulk submitter starts its own write: handing it to the lane's thread would wait for that
            # thread to win the GIL back, up to the interpreter's switch interval, while the disk idles.
            self._bulk_until = time.perf_counter() + _BULK_QUIET
            self._pump()
        else:
            # The non-blocking path (DRAM eviction demotes under the DRAM lock): no system call that can
            # take a while (io_uring_enter of a write); the lane's thread submits it.
            self._kick()

    def submit_device(self, key: ObjectKey, segment: Any, *, timeout: float = 0.0) -> bool:
        """Queue a segment held in device memory (a 1-D CuPy uint8 array: 64-byte segment header, then the
        payload) for writeback, with no host bounce: the record is laid out in a device staging buffer
        (segment copied device to device, record header made on the host over the segment header and
        copied up, zero padding) and written by the cuFile backend from there. On disk it is byte for byte
        what :meth:`submit` writes, under the same slot, generation, log and two-phase publish machinery.
        ``segment`` is not used after this returns (the copy is synchronised), so the caller may reuse its
        memory.

        Unlike :meth:`submit`, the key is not readable from memory while the write is in flight: the
        caller keeps its own copy (the Manager's DRAM) until then. A numpy array works too (the record
        is then staged in host memory: tests, backends without device I/O). False when dropped (closed,
        lane full, no ring space, generations used up). Raises ``SegmentError`` when the bytes are not a
        segment."""
        seg_len = int(segment.nbytes)
        head = _host_bytes(segment[:HEADER_SIZE]) if seg_len >= HEADER_SIZE else b""
        fmt, original, stored, pcrc = peek_segment(head)
        if seg_len != HEADER_SIZE + stored:
            raise SegmentError(f"segment of {seg_len} bytes, its header says {HEADER_SIZE + stored}")
        rec_len = record_length(seg_len)
        if timeout <= 0 and self._pending_bytes + rec_len > self.config.max_pending_bytes:
            with self._lock:
                self._c["write_dropped_total"] += 1
            return False
        buf, arr = self._staging.record_buffer(rec_len, on_device=not isinstance(segment, np.ndarray))
        lay_record_body(arr, segment)
        _sync(arr)  # the body is in place before the write can start, and ``segment`` is free again
        packed = key.pack()
        with self._lock:
            slot = self._place(self._shard_of(key), key, rec_len, seg_len, fmt, original, pcrc, buf, timeout)
            if slot is None:
                return False
            sh = self._shards[slot.shard]
            # The tag is computed on the host over the segment header: only the 128 header bytes go up.
            header, tag = record_header(sh.key, Kind.SEGMENT, packed, slot.generation, head, seg_len, slot.offset,
                                        *sh.link())
            put_record_header(arr, header)
            _sync(arr)
            sh.append(slot, tag)
            # A newer write of the key: its pending bytes must not answer for it any more.
            self._index.pending.pop(key, None)
            self._queue_write(slot, buf)
            self._c["write_device_total"] += 1
            self._c["write_device_bytes_total"] += rec_len
        self._start(timeout)
        return True

    def _kick(self) -> None:
        """Wake the writeback thread (work queued by someone who does not drive the ring). One system call
        per wake-up, not per submit: the thread clears the flag before it pumps, so work queued while the
        flag is still set is pumped by that round."""
        if not self._wake_pending:
            self._wake_pending = True
            os.eventfd_write(self._wake, 1)

    def _pump(self) -> None:
        """Drive the writeback ring: reap its completions, start queued writes in its free slots, submit
        them. Any thread may call it; never blocks on I/O nor on another driver. One thread drives at a
        time (``_ring_lock``); a caller that finds the ring driven leaves a request (``_repump``) that the
        driver serves before it lets go, so queued writes join the driver's next submission (fewer
        ``io_uring_enter`` calls) and nobody waits for the ring."""
        ring = self._wring
        with self._lock:
            self._repump = True
        while self._ring_lock.acquire(blocking=False):
            try:
                while True:
                    done = ring.reap()
                    now = time.perf_counter()
                    with self._lock:
                        if not done and not self._repump:
                            break
                        self._repump = False
                        for tag, res in done:
                            w = self._inflight.pop(tag)
                            self._inflight_bytes -= len(w.buf)
                            self._complete(w, res, now)
                        if done:
                            self._idle.notify_all()
                        cap = self._write_cap()
                        while self._queue and ring.space() > 0:
                            w = self._queue[0]
                            if self._inflight and self._inflight_bytes + len(w.buf) > cap:
                                if not w.held:
                                    w.held = True
                                    self._c["write_held_for_reads_total"] += 1
                                break  # a completion (its eventfd wakes the lane's thread) resumes
                            self._queue.popleft()
                            w.started = now
                            ring.prep_write(self._shards[w.slot.shard].fid, w.buf, w.slot.offset, w.tag)
                            self._inflight[w.tag] = w
                            self._inflight_bytes += len(w.buf)
                    unsent = ring.unsent()
                    if (unsent and not self._submit_failed and unsent < _SUBMIT_BATCH
                            and ring.submitted() >= _SUBMIT_BATCH and self._bulk_until > now):
                        # Next to a bulk submitter with enough writes in flight to keep the disk busy,
                        # writes go out _SUBMIT_BATCH per io_uring_enter: its next submit (or the lane's
                        # thread once it is quiet) sends these.
                        unsent = 0
                    if unsent or self._submit_failed:
                        # After a failed io_uring_enter the writes it was to start are still prepped in
                        # the ring (in _inflight): only a later submit sends them, even when none is new.
                        try:
                            ring.submit()
                            self._submit_failed = False
                        except SsdIoError as e:
                            self._submit_failed = True
                            self._fail_all(e)
            finally:
                self._ring_lock.release()
            with self._lock:  # a request that came in after the last check and before the release
                if not self._repump:
                    return

    def _write_cap(self) -> float:
        """Bytes of writes the lane may have in flight now (lock held): bounded while demand reads are
        in progress or just ended, unbounded (the ring's depth) otherwise."""
        limit = self.config.write_bytes_while_reading
        # The clock is read under the lock: a time taken before it could predate the last read's end.
        if limit is None or (not self._demand and time.perf_counter() >= self._demand_until):
            return float("inf")
        return limit

    def _writeback(self) -> None:
        """The lane's thread: drives the ring whenever no submitter does (completions of the last writes,
        tombstones, shutdown). Waits on the ring's eventfd and its own wake-up eventfd (GIL released)."""
        fds = [self._wake, self._wring.eventfd]
        while True:
            self._pump()
            with self._lock:
                if self._closed and not self._queue and not self._inflight:
                    return
                busy = bool(self._queue or self._inflight)
            quiet = self._bulk_until - time.perf_counter()
            if quiet > 0:
                # A bulk submitter drives the ring and reaps on every submit: waking for each completion
                # would only trade the GIL with it (futex calls, context switches) per record. Sleep on the
                # wake-up fd alone until it has been quiet for _BULK_QUIET (it waits, or it is done).
                select.select(fds[:1], [], [], quiet)
            else:
                # Busy: a completion signals the eventfd; the timeout only bounds a missed wake-up.
                select.select(fds, [], [], 0.05 if busy else 0.5)
            for fd in fds:
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass
            self._wake_pending = False

    def _fail_all(self, e: SsdIoError) -> None:
        """The ring itself failed to submit: every queued write fails (nothing was published)."""
        with self._lock:
            self._errnos["submit_failed"] += 1
            while self._queue:
                w = self._queue.popleft()
                self._complete(w, -1, time.perf_counter())
            self._idle.notify_all()

    def _complete(self, w: _Write, res: int, now: float) -> None:
        """A write ended (``res`` bytes or -errno): publish it, or count why not; settle it in the log.
        Lock held."""
        s = w.slot
        self._staging.recycle(w.buf)
        self._pending_bytes -= s.length
        self._writing -= s.length
        self._shards[s.shard].settle(s)
        if s.key is not None:
            p = self._index.pending.get(s.key)
            if p is not None and p[0] == s.generation:
                del self._index.pending[s.key]
        if res != s.length:
            s.failed = True
            self._c["write_errors_total"] += 1
            self._errnos[io_reason(res, "short_write")] += 1
            self._index.add_dead(s)
            return
        self._write_lat.append(now - w.started)
        self._c["write_completed_total"] += 1
        self._c["write_bytes_total"] += s.length
        if s.is_tombstone:
            self._c["tombstones_total"] += 1
            self._index.add_dead(s)
        elif s.cancel:  # invalidated while being written: never published (a tombstone covers it on disk)
            self._c["write_cancelled_total"] += 1
            self._index.add_dead(s)
        elif not self._index.publish(s):  # a newer generation of the key was published meanwhile
            self._c["write_cancelled_total"] += 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write ended (published, cancelled or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("SSD writeback did not drain in time")
                self._idle.wait(left if left is not None else 1.0)
