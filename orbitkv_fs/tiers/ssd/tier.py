"""The SSD tier: ring logs of records over O_DIRECT shard files, a generation index, a bounded io_uring
writeback lane and demand reads that validate every record.

Owns: the shard files, the ring allocation in each, the in-memory index ``key -> newest committed
record``, the staging buffers of the writeback lane, and the tier's counters.

Primitives (the Manager's :class:`~orbitkv_fs.manager.LowerTier` seam, plus a few for tools and tests):

* :meth:`SsdTier.submit` -- stage a segment and queue its write; never waits for I/O; False = dropped.
* :meth:`SsdTier.read` / :meth:`SsdTier.read_many` -- demand reads under a lease, validated (record header
  CRC, key, generation, segment header and payload CRC32C). A key submitted but not yet committed is
  served from the bytes :meth:`SsdTier.submit` was handed (see invariant 7).
* :meth:`SsdTier.prefetch` -- speculative reads on a background lane (own ring and thread), validated
  like demand reads and handed to the caller's sink; bounded in depth and bytes.
* The cuFile direct path (:attr:`SsdTier.device_io`: the cuFile backend): :meth:`SsdTier.submit_device`
  writes a segment held in device memory (the record laid out in a device staging buffer, byte for byte
  the record :meth:`SsdTier.submit` writes, same slots, generations and two-phase publish);
  :meth:`SsdTier.read_many_device` reads records into bounded device windows, checks their record and
  segment headers on the host (only those bytes come down) and hands device views of the segments to a
  consumer that checks the payload CRC32C on the GPU (the Manager's codec engine) and names the failures;
  :meth:`SsdTier.describe` gives sizes before reading. The demand-read bookkeeping (leases, demand count,
  settlement) is shared with :meth:`SsdTier.read_many`.
* :meth:`SsdTier.contains`, :meth:`SsdTier.invalidate`, :meth:`SsdTier.flush`, :meth:`SsdTier.iter_objects`,
  :meth:`SsdTier.iter_records`, :meth:`SsdTier.snapshot` (typed :class:`SsdStats`), :meth:`SsdTier.stats`
  (flat mapping), :meth:`SsdTier.close`.

Invariants:

1. Two-phase publish: a record is WRITING from allocation until its write completed in full; only then is
   it COMMITTED and put in the index (replacing the key's older record, which becomes DEAD).
2. The ring overwrites the oldest records, never a WRITING record or one under a read lease: the allocator
   skips past such records, and drops the write (counted) when a whole lap finds no room.
3. A record that fails validation is a miss: that generation is removed from the index at once (DEAD,
   counted as corrupt) and its space is reclaimed when its leases drain; resubmitting the key repairs it.
   An I/O error on a read is a miss that invalidates nothing.
4. The writeback lane is bounded in queue depth and staged bytes; beyond that, submits drop (counted).
   Demand reads go through their own rings, never behind queued writebacks. While a demand read is in
   progress, and for ``demand_holdoff`` seconds after the last one ended, the lane starts a write only
   while fewer than ``write_bytes_while_reading`` bytes of writes are in flight (always at least one
   write): a read waits behind every write the device already holds, so the bytes in flight bound it.
   Staging buffers of 64 KiB and more live in huge pages, so a large write reaches the device as a few
   contiguous segments, not one per 4 KiB page. The writeback ring is driven
   by whichever thread gets to it first (``_pump``: a bulk submitter starts its own write; the lane's
   thread takes over when nobody does), so a bulk write never waits for another thread to get the GIL.
5. Invalidated records have their header block zeroed once unleased, so ``recover`` cannot bring them back.
6. Ephemeral by default (files truncated at start); with ``recover`` every record is validated and the
   newest valid generation of each key is served again.
7. No gap while demoting: from ``submit`` until its write completes, :meth:`SsdTier.contains` and the reads
   answer for the key from the submitted (immutable) segment bytes, kept in a pending map beside the
   index; the index itself still only holds completed writes. The pending entry goes when that write
   completes (committed, cancelled or failed), when a newer submit replaces it, or on invalidation.
8. The prefetch lane never delays demand reads: it starts no read while a demand read is in progress
   (reads it already started finish; at most ``prefetch_queue_depth``). A prefetched record is validated
   like a demand read; a corrupt one is invalidated and never reaches the sink.
9. A record written from device memory is not readable from memory while its write is in flight (the
   caller keeps its own copy meanwhile: the Manager's DRAM); once published, a :meth:`SsdTier.submit` of
   the very same segment (DRAM evicting its copy) writes nothing. Device reads follow invariant 3: a bad
   record header, or a payload the consumer finds corrupt, invalidates only that generation, and each
   record stays leased until the consumer is done with its window.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import enum
import errno
import logging
import mmap
import os
import re
import select
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ...errors import OrbitKVError, SegmentError
from ...keys import ObjectKey
from ...segment import HEADER_SIZE, MAGIC, Format, crc32c, parse_header
from .record import (BLOCK, MAX_RECORD, RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, Status, lay_record_body,
                     pack_record_header_into, put_record_header, record_header, record_length, scan, verify_record,
                     verify_record_head, write_record_body)
from .uring import HUGE_PAGE, IoBackend, IoRing, SsdIoError, UringBackend, aligned_buffer

if TYPE_CHECKING:
    from ...manager import TierCounts

log = logging.getLogger(__name__)

#: Writes can only be in flight within this many generations of the newest (the lane's depth is capped
#: below it), which is what tells a torn record from a corrupt one at recovery.
MAX_QUEUE_DEPTH = 1024
_LATENCY_SAMPLES = 4096
#: Staging buffers from this size up live in huge pages (see ``SsdTier._staging``; 64 KiB demand reads
#: ran 2-3x faster from them on the development VM); smaller ones (header wipes) in ordinary pages.
_HUGE_MIN = 64 << 10


#: Seconds after a bulk submitter last drove the writeback ring during which the lane's thread leaves
#: completions to it (see ``SsdTier._writeback``).
_BULK_QUIET = 0.002
#: Writes per io_uring_enter next to a bulk submitter once that many are in flight.
_SUBMIT_BATCH = 4


class SsdConfigError(OrbitKVError, ValueError):
    """The SSD tier's settings are not usable."""


@dataclass(frozen=True)
class SsdConfig:
    paths: tuple[str, ...]
    #: Total bytes over all shards (split evenly, rounded down to 4 KiB).
    capacity: int
    backend: str = "auto"  # auto | uring | cufile
    #: Writes in flight on the io_uring writeback lane.
    write_queue_depth: int = 32
    #: Reads in flight per demand-read ring (one ring per concurrent reader).
    read_queue_depth: int = 32
    #: Bytes staged for writeback (queued + in flight); submits beyond it drop.
    max_pending_bytes: int = 256 << 20
    recover: bool = False
    #: Speculative prefetch lane (:meth:`SsdTier.prefetch`): reads in flight, and record bytes queued or
    #: in flight (requests beyond it are dropped, counted); 0 bytes turns the lane off.
    prefetch_queue_depth: int = 4
    prefetch_max_bytes: int = 64 << 20
    #: Demand-read priority: while a demand read is in progress, and for ``demand_holdoff`` seconds after
    #: the last one ended (a restore reads in batches), the writeback lane keeps at most this many bytes
    #: of writes in flight (at least one write). The device serves a read after the writes it already
    #: holds: with 32 x 1 MiB in flight, 64 KiB reads waited about 20 ms at p50 on the development VM;
    #: 1 MiB read best of 1/2/4/8 MiB there (docs/results/2026-11-29-ssd-3). None turns the throttle off.
    write_bytes_while_reading: int | None = 1 << 20
    demand_holdoff: float = 0.01

    def __post_init__(self) -> None:
        if not self.paths:
            raise SsdConfigError("at least one --ssd-cache-path is needed")
        if len(set(self.paths)) != len(self.paths):
            raise SsdConfigError("--ssd-cache-path given twice for the same file")
        if self.backend not in ("auto", "uring", "cufile"):
            raise SsdConfigError(f"--ssd-backend {self.backend!r}: expected auto, uring or cufile")
        if not 1 <= self.write_queue_depth <= MAX_QUEUE_DEPTH:
            raise SsdConfigError(f"--ssd-write-queue-depth must be 1..{MAX_QUEUE_DEPTH}")
        if not 1 <= self.read_queue_depth <= MAX_QUEUE_DEPTH:
            raise SsdConfigError(f"read_queue_depth must be 1..{MAX_QUEUE_DEPTH}")
        if self.capacity // len(self.paths) < (1 << 20):
            raise SsdConfigError("--ssd-cache-capacity leaves less than 1 MiB per shard")
        if self.max_pending_bytes < MAX_RECORD:
            raise SsdConfigError(f"max_pending_bytes must hold at least one record ({MAX_RECORD} bytes)")
        if not 1 <= self.prefetch_queue_depth <= MAX_QUEUE_DEPTH:
            raise SsdConfigError(f"prefetch_queue_depth must be 1..{MAX_QUEUE_DEPTH}")
        if self.prefetch_max_bytes < 0:
            raise SsdConfigError("prefetch_max_bytes must be >= 0")
        if self.write_bytes_while_reading is not None and self.write_bytes_while_reading < 0:
            raise SsdConfigError("write_bytes_while_reading must be >= 0 (or None: no throttle)")
        if not self.demand_holdoff >= 0:
            raise SsdConfigError("demand_holdoff must be >= 0 seconds")


@dataclass(frozen=True)
class SsdStats:
    """A snapshot of the tier's counters (``_total``) and gauges."""

    capacity_bytes: int
    shards: int
    backend: str
    objects: int
    live_bytes: int  # records in the index
    dead_bytes: int  # superseded, invalidated or corrupt records still occupying ring space
    writing_bytes: int  # records allocated, write not yet completed
    pending_bytes: int  # staged for writeback (queued + in flight)
    write_inflight_bytes: int  # writes submitted to the device, not completed
    write_submitted_total: int
    write_completed_total: int
    write_bytes_total: int
    write_errors_total: int
    write_dropped_total: int  # lane full, no room in the ring, record too large
    write_skipped_blocked_total: int  # allocator skips past WRITING or leased records
    write_cancelled_total: int  # completed writes not published (invalidated/superseded meanwhile)
    write_held_for_reads_total: int  # writes whose start waited for demand reads (write_bytes_while_reading)
    evicted_total: int
    evicted_bytes_total: int
    read_total: int
    read_hits_total: int
    read_bytes_total: int
    read_errors_total: int
    read_pending_hits_total: int  # reads served from submitted segments whose write had not completed
    prefetch_requested_total: int  # keys queued on the prefetch lane
    prefetch_read_total: int  # records the lane read and validated, handed to the caller's sink
    prefetch_read_bytes_total: int  # their segment bytes
    prefetch_dropped_total: int  # requests over the lane's byte bound, or gone before their read started
    prefetch_errors_total: int  # I/O errors on the lane (corrupt records count in corrupt_records_total)
    corrupt_records_total: int
    invalidated_total: int
    wipes_total: int
    recovered_records: int
    recovered_torn_total: int
    recovered_corrupt_total: int
    read_latency_p50_seconds: float
    read_latency_p99_seconds: float
    write_latency_p50_seconds: float
    write_latency_p99_seconds: float
    errors_by_errno: dict[str, int] = field(default_factory=dict)
    #: The cuFile direct path: records written from device memory (:meth:`SsdTier.submit_device`) and
    #: their record bytes; submits of a segment already on disk as its key's record (DRAM evicting a copy
    #: read back from here, or one a direct write stored: not written again); records read into device
    #: memory (:meth:`SsdTier.read_many_device`) and handed on, and their bytes.
    write_device_total: int = 0
    write_device_bytes_total: int = 0
    write_already_stored_total: int = 0
    read_device_total: int = 0
    read_device_bytes_total: int = 0


@dataclass(frozen=True)
class SsdObject:
    key: ObjectKey
    stored_bytes: int  # segment bytes (header + payload)
    format: Format
    original_length: int
    generation: int
    shard: int
    offset: int


class _State(enum.Enum):
    WRITING = 1
    COMMITTED = 2
    DEAD = 3
    WIPING = 4  # zeroing the header block of an invalidated record


class _Slot:
    __slots__ = ("shard", "offset", "length", "key", "generation", "state", "leases", "stored", "format",
                 "original", "wipe", "zeroed", "crc")

    def __init__(self, shard: int, offset: int, length: int, key: ObjectKey, generation: int,
                 stored: int, fmt: Format, original: int, crc: int = 0) -> None:
        self.shard, self.offset, self.length, self.key, self.generation = shard, offset, length, key, generation
        self.state = _State.WRITING
        self.leases = 0
        self.stored, self.format, self.original = stored, fmt, original
        # The payload CRC32C of the segment: a later submit of the same segment (DRAM evicting its copy)
        # finds it on disk already and is not written again.
        self.crc = crc
        self.wipe = False  # zero the header block once unleased (invalidated)
        self.zeroed = False  # the header block on disk is zero: recovery cannot revive this record

    @property
    def end(self) -> int:
        return self.offset + self.length


class _Shard:
    def __init__(self, index: int, path: str, fid: int, capacity: int) -> None:
        self.index, self.path, self.fid, self.capacity = index, path, fid, capacity
        self.head = 0
        self.offsets: list[int] = []
        self.slots: dict[int, _Slot] = {}

    def insert(self, slot: _Slot) -> None:
        bisect.insort(self.offsets, slot.offset)
        self.slots[slot.offset] = slot

    def remove(self, slot: _Slot) -> None:
        i = bisect.bisect_left(self.offsets, slot.offset)
        del self.offsets[i]
        del self.slots[slot.offset]


@dataclass(slots=True)
class _Write:
    tag: int
    slot: _Slot
    buf: memoryview
    wipe: bool = False
    started: float = 0.0
    held: bool = False  # held back at least once for demand reads (counted once)


def _percentile(samples: "collections.deque[float]", q: float) -> float:
    if not samples:
        return 0.0
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


# Fields of the segment header a submit needs (docs/format.md): format @6, original and stored length @16,
# payload CRC32C @24.
_SEG_FIELDS = struct.Struct("<4s2xB9xIII")
_FORMATS = {int(f): f for f in Format}


def _peek_segment(segment: "bytes | memoryview") -> tuple[Format, int, int, int]:
    """Format, original and stored length of a segment the caller vouches for (the Manager admits only
    CRC-valid segments). Checks the magic and the header CRC, so a wrong buffer is a typed error; the full
    validation, payload CRC included, happens on every read. A fraction of :func:`parse_header` 's cost,
    which matters on the submit path of small records. Also answers the payload CRC32C the header names."""
    if len(segment) < HEADER_SIZE:
        raise SegmentError(f"{len(segment)} bytes cannot hold a segment header")
    head = bytes(segment[:HEADER_SIZE])
    magic, fmt, original, stored, pcrc = _SEG_FIELDS.unpack_from(head)
    if magic != MAGIC or crc32c(head[:60]) != int.from_bytes(head[60:], "little") or fmt not in _FORMATS:
        parse_header(head)  # raises the precise typed error
        raise SegmentError("segment header does not validate")
    return _FORMATS[fmt], original, stored, pcrc


def _reason(res: int, short: str) -> str:
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


def make_backend(name: str) -> IoBackend:
    """The I/O backend for ``--ssd-backend``. ``auto`` is io_uring: DRAM demotion hands the tier host bytes,
    which io_uring moves best; cuFile (kvikio) only when asked (GPU machines): then the Manager also
    writes complete GPU batches from device memory and restores GPU pages from device reads."""
    if name == "cufile":
        from .cufile import CuFileBackend, cufile_usable

        if not cufile_usable():
            raise SsdConfigError("--ssd-backend cufile needs kvikio and a CUDA GPU")
        return CuFileBackend()
    return UringBackend()


class SsdTier:
    """The SSD lower tier (see the module docstring). Thread-safe."""

    name = "ssd"

    def __init__(self, config: SsdConfig, *, backend: IoBackend | None = None) -> None:
        self.config = config
        self._io = backend if backend is not None else make_backend(config.backend)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: dict[ObjectKey, _Slot] = {}
        #: key -> (generation, segment bytes) of the newest submit whose write has not completed.
        self._pending_segments: dict[ObjectKey, tuple[int, bytes]] = {}
        self._c: collections.Counter[str] = collections.Counter()
        self._errnos: collections.Counter[str] = collections.Counter()
        self._read_lat: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._write_lat: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._live = self._dead = self._writing = self._pending_bytes = 0
        self._queue: collections.deque[_Write] = collections.deque()
        self._inflight: dict[int, _Write] = {}
        self._inflight_bytes = 0
        self._pool: dict[int, list[memoryview]] = {}
        self._pool_bytes = 0
        # Device staging (the cuFile direct path): size class -> free block-aligned CuPy buffers, and the
        # whole buffer behind each buffer handed out (by device address).
        self._dpool: dict[int, list[Any]] = {}
        self._dpool_bytes = 0
        self._downers: dict[int, Any] = {}
        # Lock order: _ring_lock, then _lock, then _pool_lock.
        self._pool_lock = threading.Lock()
        self._ring_lock = threading.Lock()  # one driver of the writeback ring at a time
        self._repump = False  # a _pump() call found the ring driven: the driver goes round once more
        self._submit_failed = False  # the last writeback submit raised: the next _pump submits again (_ring_lock)
        self._generation = 1
        self._closed = False
        # Prefetch lane: (key, record bytes, sink) queued; its thread starts with the first request.
        self._pf_queue: collections.deque[tuple[ObjectKey, int, Callable[[ObjectKey, bytes], None]]] = \
            collections.deque()
        self._pf_keys: set[ObjectKey] = set()  # queued or in flight
        self._pf_bytes = 0
        self._pf_cond = threading.Condition(self._lock)
        self._pf_thread: threading.Thread | None = None
        self._demand = 0  # demand reads in progress: the prefetch lane starts nothing meanwhile
        self._demand_until = 0.0  # perf_counter() until which writeback stays throttled after demand reads
        per_shard = config.capacity // len(config.paths) // BLOCK * BLOCK
        self._shards: list[_Shard] = []
        try:
            for i, path in enumerate(config.paths):
                fid = self._io.open(path, per_shard, truncate=not config.recover)
                self._shards.append(_Shard(i, path, fid, per_shard))
            if config.recover:
                self._recover()
            self._wring = self._io.ring(config.write_queue_depth)
        except BaseException:
            self._io.close()
            raise
        self._read_rings: list[IoRing] = []
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # A wake-up is written and not yet consumed: further kicks need no system call (see _kick).
        self._wake_pending = False
        self._bulk_until = 0.0  # perf_counter until which a bulk submitter (submit with a timeout) drives the ring
        self._writer = threading.Thread(target=self._writeback, name="orbitkv-ssd-writeback", daemon=True)
        self._writer.start()

    # -------------------------------------------------------------------------------------- recovery

    def _recover(self) -> None:
        newest = 0
        for sh in self._shards:
            with open(sh.path, "rb") as f:
                size = min(os.fstat(f.fileno()).st_size, sh.capacity)
                if size < BLOCK:
                    continue
                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as image:
                    image.madvise(mmap.MADV_SEQUENTIAL)
                    head_gen = 0
                    for e in scan(memoryview(image), in_flight_window=MAX_QUEUE_DEPTH):
                        if e.status is Status.TORN:
                            self._c["recovered_torn_total"] += 1
                        elif e.status is Status.CORRUPT:
                            self._c["recovered_corrupt_total"] += 1
                        if e.header is not None and e.header.generation > head_gen:
                            head_gen = e.header.generation
                            sh.head = e.offset + (e.header.record_length if e.status is Status.VALID else BLOCK)
                        if e.status is not Status.VALID:
                            continue
                        rh, seg = e.header, e.segment
                        slot = _Slot(sh.index, e.offset, rh.record_length, rh.key, rh.generation,
                                     rh.segment_length, seg.format, seg.original_length, seg.payload_crc)
                        sh.insert(slot)
                        old = self._index.get(rh.key)
                        if old is None or old.generation < rh.generation:
                            if old is not None:
                                old.state = _State.DEAD
                                self._live -= old.length
                                self._dead += old.length
                            slot.state = _State.COMMITTED
                            self._index[rh.key] = slot
                            self._live += slot.length
                        else:
                            slot.state = _State.DEAD
                            self._dead += slot.length
                    newest = max(newest, head_gen)
                    if sh.head >= sh.capacity:
                        sh.head = 0
        self._c["recovered_records"] = len(self._index)
        self._generation = newest + MAX_QUEUE_DEPTH + 1  # past any torn write's generation

    # -------------------------------------------------------------------------------------- allocation

    def _shard_of(self, key: ObjectKey) -> _Shard:
        return self._shards[crc32c(key.pack()) % len(self._shards)]

    def _allocate(self, sh: _Shard, length: int) -> int | None:
        """Find ``length`` bytes at or after the ring head, evicting unleased committed/dead records.
        Lock held."""
        if length > sh.capacity:
            return None
        pos, travelled = sh.head, 0
        while travelled <= sh.capacity:
            if pos + length > sh.capacity:
                travelled += sh.capacity - pos
                pos = 0
                continue
            i = bisect.bisect_left(sh.offsets, pos)
            if i > 0 and sh.slots[sh.offsets[i - 1]].end > pos:
                i -= 1
            victims, blocker = [], None
            while i < len(sh.offsets) and sh.offsets[i] < pos + length:
                s = sh.slots[sh.offsets[i]]
                if s.state in (_State.WRITING, _State.WIPING) or s.leases:
                    blocker = s
                    break
                victims.append(s)
                i += 1
            if blocker is not None:
                self._c["write_skipped_blocked_total"] += 1
                travelled += blocker.end - pos
                pos = blocker.end
                continue
            for s in victims:
                self._drop_slot(s, evicted=True)
            sh.head = pos + length
            return pos
        return None

    def _drop_slot(self, s: _Slot, *, evicted: bool) -> None:
        """Remove a record from its ring (its space is being reused). Lock held."""
        if s.state is _State.COMMITTED:
            if self._index.get(s.key) is s:
                del self._index[s.key]
            self._live -= s.length
            if evicted:
                self._c["evicted_total"] += 1
                self._c["evicted_bytes_total"] += s.stored
        else:
            self._dead -= s.length
        self._shards[s.shard].remove(s)

    def _kill(self, s: _Slot) -> None:
        """Hide a committed record from readers now; its space is reclaimed when unleased. Lock held."""
        if s.state is _State.COMMITTED:
            if self._index.get(s.key) is s:
                del self._index[s.key]
            self._live -= s.length
            self._dead += s.length
            s.state = _State.DEAD

    # -------------------------------------------------------------------------------------- writeback

    def _staging(self, nbytes: int) -> memoryview:
        """A page-aligned buffer of ``nbytes`` from the pool (own lock: taken with or without ``_lock``).

        Buffers of 64 KiB and more live in huge pages (carved: 2 MiB / size class per page): over 4 KiB
        pages a 1 MiB O_DIRECT write is 256 scattered segments, which the development VM's virtio disk
        served so slowly (about 55 ms queued per write against 2 ms) that reads behind them waited
        20-50 ms."""
        cls = 1 << max(12, (nbytes - 1).bit_length())
        with self._pool_lock:
            free = self._pool.get(cls)
            if free:
                self._pool_bytes -= cls
                return free.pop()[:nbytes]
        if cls < _HUGE_MIN:
            return aligned_buffer(cls)[:nbytes]
        if cls >= HUGE_PAGE:
            return aligned_buffer(cls, huge=True)[:nbytes]
        # A class below the huge page: carve the page into views that each own their part (a ctypes
        # array is the exporter ``_recycle`` finds in ``buf.obj``); the spare ones go to the pool. A pool
        # with no room for them would drop them: a 2 MiB page held for one small buffer, so no carving then.
        with self._pool_lock:
            room = self._pool_bytes + HUGE_PAGE - cls <= self.config.max_pending_bytes
        if not room:
            return aligned_buffer(cls)[:nbytes]
        page = aligned_buffer(HUGE_PAGE, huge=True)
        views = [memoryview((ctypes.c_char * cls).from_buffer(page, i * cls)).cast("B")
                 for i in range(HUGE_PAGE // cls)]
        for v in views[1:]:
            self._recycle(v)
        return views[0][:nbytes]

    def _recycle(self, buf: Any) -> None:
        if not isinstance(buf, memoryview):  # a device staging buffer (submit_device, read_many_device)
            self._recycle_device(buf)
            return
        base = buf.obj
        if isinstance(base, mmap.mmap):
            view = memoryview(base)
        elif isinstance(base, ctypes.Array):
            view = memoryview(base).cast("B")
        else:
            return
        cls = len(view)
        with self._pool_lock:
            if self._pool_bytes + cls <= self.config.max_pending_bytes:
                self._pool.setdefault(cls, []).append(view)
                self._pool_bytes += cls

    def submit(self, key: ObjectKey, segment: "bytes | memoryview", *, timeout: float = 0.0) -> bool:
        """Queue ``segment`` for writeback (copied into an aligned staging buffer). False when dropped:
        the tier is closed, the lane is full, or no ring space can be found. By default it never waits
        and leaves the submission to the lane's thread; with ``timeout`` (callers that demote in bulk,
        such as a DRAM flush) it waits up to that many seconds for room in the lane and submits the write
        itself. A segment already on disk as ``key``'s published record (same length, format and payload
        CRC32C: DRAM evicting a copy it read back from here, or one :meth:`submit_device` wrote) is not
        written again (True, ``write_already_stored_total``). Raises ``SegmentError`` when ``segment`` is
        not a segment."""
        fmt, original, stored, pcrc = _peek_segment(segment)
        if not isinstance(segment, bytes):  # kept for readers until the write lands: must not change
            segment = bytes(segment)
        seg_len = HEADER_SIZE + stored
        if len(segment) != seg_len:
            raise SegmentError(f"segment of {len(segment)} bytes, its header says {seg_len}")
        if self._already_stored(key, seg_len, fmt, original, pcrc):
            return True
        rec_len = record_length(seg_len)
        if timeout <= 0 and self._pending_bytes + rec_len > self.config.max_pending_bytes:
            # The lane is full (an unlocked peek, rechecked below): drop before paying for the copy.
            with self._lock:
                self._c["write_dropped_total"] += 1
            return False
        # The copy into the staging buffer runs before any lock; only the header waits for the generation.
        buf = self._staging(rec_len)
        write_record_body(buf, segment)
        with self._lock:
            slot = self._place(key, rec_len, seg_len, fmt, original, pcrc, buf, timeout)
            if slot is None:
                return False
            pack_record_header_into(buf, key.pack(), slot.generation, seg_len, rec_len)
            self._pending_segments[key] = (slot.generation, segment)
            self._queue.append(_Write(slot.generation, slot, buf))
            self._c["write_submitted_total"] += 1
        self._start(timeout)
        return True

    def _already_stored(self, key: ObjectKey, seg_len: int, fmt: Format, original: int, pcrc: int) -> bool:
        """True (counted) when the key's published record holds a segment with these header fields and no
        newer submit is pending: its bytes are on disk already. Without this, every chunk a lookup
        promoted from here was written again when DRAM evicted it (the H200 cohort's ``ssd/none`` run read
        11.9 GB back and wrote 32.9 GB in its minute, beside its demand reads)."""
        s = self._index.get(key)  # an unlocked peek first: the common case is a new key
        if s is None:
            return False
        with self._lock:
            s = self._index.get(key)
            same = (s is not None and s.stored == seg_len and s.format == fmt and s.original == original
                    and s.crc == pcrc and key not in self._pending_segments and not self._closed)
            if same:
                self._c["write_already_stored_total"] += 1
            return same

    def _place(self, key: ObjectKey, rec_len: int, seg_len: int, fmt: Format, original: int, pcrc: int,
               buf: Any, timeout: float) -> "_Slot | None":
        """Ring space and a generation for a record of ``rec_len`` bytes staged in ``buf``: a WRITING slot,
        counted as writing and pending. Waits up to ``timeout`` for room; None (counted as dropped, ``buf``
        recycled) when closed or no room. Lock held."""
        deadline = time.monotonic() + timeout
        sh = self._shard_of(key)
        while True:
            if self._closed:
                self._recycle(buf)
                return None
            offset = None
            if self._pending_bytes + rec_len <= self.config.max_pending_bytes:
                offset = self._allocate(sh, rec_len)
            if offset is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not (self._queue or self._inflight):  # nothing in flight will make room
                self._c["write_dropped_total"] += 1
                self._recycle(buf)
                return None
            self._idle.wait(left)
        gen = self._generation
        self._generation += 1
        slot = _Slot(sh.index, offset, rec_len, key, gen, seg_len, fmt, original, pcrc)
        sh.insert(slot)
        self._writing += rec_len
        self._pending_bytes += rec_len
        return slot

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

    # -------------------------------------------------------------------------------------- device memory

    @property
    def device_io(self) -> bool:
        """The backend moves device memory itself (cuFile): :meth:`submit_device` and
        :meth:`read_many_device` then never bounce through host memory."""
        return getattr(self._io, "name", "") == "cufile"

    def submit_device(self, key: ObjectKey, segment: Any, *, timeout: float = 0.0) -> bool:
        """Queue a segment held in device memory (a 1-D CuPy uint8 array: 64-byte segment header, then the
        payload) for writeback, with no host bounce: the record is laid out in a device staging buffer
        (segment copied device to device, record header built on the host and copied up, zero padding)
        and written by the cuFile backend from there. On disk it is byte for byte what :meth:`submit`
        writes, under the same slot, generation and two-phase publish machinery. ``segment`` is not used
        after this returns (the copy is synchronised), so the caller may reuse its memory.

        Unlike :meth:`submit`, the key is not readable from memory while the write is in flight: the
        caller keeps its own copy (the Manager's DRAM) until then. A numpy array works too (the record
        is then staged in host memory: tests, backends without device I/O). False when dropped (closed,
        lane full, no ring space). Raises ``SegmentError`` when the bytes are not a segment."""
        seg_len = int(segment.nbytes)
        head = _host_bytes(segment[:HEADER_SIZE]) if seg_len >= HEADER_SIZE else b""
        fmt, original, stored, pcrc = _peek_segment(head)
        if seg_len != HEADER_SIZE + stored:
            raise SegmentError(f"segment of {seg_len} bytes, its header says {HEADER_SIZE + stored}")
        rec_len = record_length(seg_len)
        if timeout <= 0 and self._pending_bytes + rec_len > self.config.max_pending_bytes:
            with self._lock:
                self._c["write_dropped_total"] += 1
            return False
        buf, arr = self._record_buffer(rec_len, on_device=not isinstance(segment, np.ndarray))
        lay_record_body(arr, segment)
        _sync(arr)  # the body is in place before the write can start, and ``segment`` is free again
        with self._lock:
            slot = self._place(key, rec_len, seg_len, fmt, original, pcrc, buf, timeout)
            if slot is None:
                return False
            # Under the lock, like submit's header: the write may start as soon as it is queued. One
            # 128-byte copy to the device.
            put_record_header(arr, record_header(key.pack(), slot.generation, seg_len))
            _sync(arr)
            # A newer write of the key: its pending bytes must not answer for it any more.
            self._pending_segments.pop(key, None)
            self._queue.append(_Write(slot.generation, slot, buf))
            self._c["write_submitted_total"] += 1
            self._c["write_device_total"] += 1
            self._c["write_device_bytes_total"] += rec_len
        self._start(timeout)
        return True

    def _record_buffer(self, nbytes: int, *, on_device: bool) -> tuple[Any, Any]:
        """A staging buffer for a record of ``nbytes`` and a 1-D uint8 array over it: a block-aligned
        device buffer from the device pool, or a host staging buffer (``_staging``) and a numpy view."""
        if not on_device:
            buf = self._staging(nbytes)
            return buf, np.frombuffer(buf, dtype=np.uint8)
        cls = 1 << max(12, (nbytes - 1).bit_length())
        with self._pool_lock:
            free = self._dpool.get(cls)
            if free:
                whole = free.pop()
                self._dpool_bytes -= cls
            else:
                whole = None
        if whole is None:
            import cupy

            raw = cupy.empty(cls + BLOCK, dtype=cupy.uint8)
            skip = -raw.data.ptr % BLOCK  # GDS moves block-aligned device buffers without a bounce
            whole = raw[skip:skip + cls]
        buf = whole[:nbytes]
        with self._pool_lock:
            self._downers[buf.data.ptr] = whole
        return buf, buf

    def _recycle_device(self, buf: Any) -> None:
        with self._pool_lock:
            whole = self._downers.pop(buf.data.ptr, None)
            if whole is None:
                return
            cls = int(whole.nbytes)
            if self._dpool_bytes + cls <= self.config.max_pending_bytes:
                self._dpool.setdefault(cls, []).append(whole)
                self._dpool_bytes += cls

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
        wipes, shutdown). Waits on the ring's eventfd and its own wake-up eventfd (GIL released)."""
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
        """A write finished (``res`` bytes or -errno). Lock held."""
        s = w.slot
        self._recycle(w.buf)
        if w.wipe:  # the header block of an invalidated record is zero now (or could not be zeroed)
            self._c["wipes_total" if res == BLOCK else "write_errors_total"] += 1
            s.zeroed = res == BLOCK
            s.state = _State.DEAD
            self._dead += s.length
            return
        self._pending_bytes -= s.length
        self._writing -= s.length
        p = self._pending_segments.get(s.key)
        if p is not None and p[0] == s.generation:
            del self._pending_segments[s.key]
        if res != s.length:
            self._c["write_errors_total"] += 1
            self._errnos[_reason(res, "short_write")] += 1
            s.state = _State.DEAD
            self._dead += s.length
            return
        self._write_lat.append(now - w.started)
        self._c["write_completed_total"] += 1
        self._c["write_bytes_total"] += s.length
        if s.wipe:  # invalidated while being written: never published
            self._c["write_cancelled_total"] += 1
            s.state = _State.DEAD
            self._dead += s.length
            self._queue_wipe(s)
            return
        old = self._index.get(s.key)
        if old is not None and old.generation > s.generation:
            self._c["write_cancelled_total"] += 1
            s.state = _State.DEAD
            self._dead += s.length
            return
        if old is not None:
            self._kill(old)
        s.state = _State.COMMITTED
        self._live += s.length
        self._index[s.key] = s

    def _queue_wipe(self, s: _Slot) -> None:
        """Zero the header block of an invalidated, unleased record so recovery cannot revive it. The
        slot is WRITING meanwhile, so the allocator cannot hand its space out under the wipe. Lock held."""
        if s.leases or s.state is not _State.DEAD or self._shards[s.shard].slots.get(s.offset) is not s:
            return
        s.wipe = False
        s.state = _State.WIPING
        self._dead -= s.length
        buf = self._staging(BLOCK)
        buf[:] = bytes(BLOCK)
        tag = self._generation
        self._generation += 1
        self._queue.append(_Write(tag, s, buf, wipe=True))
        self._kick()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write completed (published, cancelled or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("SSD writeback did not drain in time")
                self._idle.wait(left if left is not None else 1.0)

    # -------------------------------------------------------------------------------------- reads

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._index or key in self._pending_segments

    def read(self, key: ObjectKey) -> bytes | None:
        """The validated segment bytes of ``key``, or None (absent, I/O error, or corrupt)."""
        return self.read_many([key])[0]

    def read_many(self, keys: Sequence[ObjectKey],
                  sink: "Callable[[int, bytes], None] | None" = None) -> list[bytes | None]:
        """Demand-read several keys at once (up to the read queue depth in flight).

        With ``sink``, each segment is handed to ``sink(index, segment)`` as soon as it is validated and
        not kept in the returned list (which then holds None for it): a consumer that stores segments
        elsewhere (DRAM) never holds more than the reads in flight. The segment is then a view valid
        during the call only (of the read buffer itself, reused afterwards): copy what you keep."""
        begun = self._begin_reads(keys)
        if begun is None:
            return [None] * len(keys)
        slots, staged, ring = begun
        out: list[bytes | None] = [None] * len(keys)
        verdicts: dict[int, str] = {}  # index -> why it is a miss: "corrupt" or the I/O error
        hits: set[int] = set()
        bufs: dict[int, memoryview] = {}  # reads in flight -> their buffers
        broken = False  # the ring raised: reads may sit in it prepped, never submitted
        try:
            # Inside the try: a sink that raises must still give back the leases and the demand count.
            for i, data in staged.items():
                if sink is None:
                    out[i] = data
                else:
                    sink(i, data)
            if ring is None:
                ring = self._io.ring(self.config.read_queue_depth)
            todo = [i for i, s in enumerate(slots) if s is not None]
            started: dict[int, float] = {}
            pos = 0

            def fill() -> bool:
                nonlocal pos
                n = pos
                while pos < len(todo) and ring.space() > 0:
                    i = todo[pos]
                    s = slots[i]
                    bufs[i] = self._staging(s.length)
                    started[i] = time.perf_counter()
                    ring.prep_read(self._shards[s.shard].fid, bufs[i], s.offset, i)
                    pos += 1
                return pos > n

            while pos < len(todo) or bufs:
                fill()
                landed = [(i, res, bufs.pop(i)) for i, res in ring.submit_and_wait()]
                # The freed slots get their next reads before this thread validates what landed: at
                # 64 KiB and a shallow queue, checking and copying a batch takes as long as the device
                # needs to drain the reads still in flight.
                if fill():
                    ring.submit()
                for i, res, buf in landed:
                    # Validate as each read lands, so only the reads in flight hold buffers. A sink gets a
                    # view of the read buffer itself (no copy), which goes back to the pool after it.
                    data, why = self._check_read(slots[i], res, buf, keep=sink is not None)
                    try:
                        if data is None:
                            verdicts[i] = why
                            continue
                        self._read_lat.append(time.perf_counter() - started[i])
                        hits.add(i)
                        if sink is None:
                            out[i] = data
                        else:
                            sink(i, data)
                    finally:
                        del data
                        if sink is not None:
                            self._recycle(buf)
        except SsdIoError:
            broken = True
            raise
        finally:
            self._end_reads(ring, broken, bufs, len(keys), slots, hits, verdicts)
        return out

    def _begin_reads(self, keys: Sequence[ObjectKey]) -> "tuple[list[_Slot | None], dict[int, bytes], IoRing | None] | None":
        """Start a demand read of ``keys``: the demand count goes up (writeback throttles, the prefetch
        lane waits), each published record gets a read lease. Answers the slots (None: not published),
        the bytes of keys submitted but not yet written (index -> segment) and a pooled read ring (None:
        make one); None when the tier is closed. :meth:`_end_reads` undoes it all."""
        with self._lock:
            if self._closed:
                return None
            self._demand += 1
            slots: list[_Slot | None] = []
            staged: dict[int, bytes] = {}  # submitted, write not completed: served from memory
            for i, k in enumerate(keys):
                p = self._pending_segments.get(k)
                if p is not None:
                    staged[i] = p[1]
                    slots.append(None)
                    continue
                s = self._index.get(k)
                if s is not None:
                    s.leases += 1
                slots.append(s)
            self._c["read_pending_hits_total"] += len(staged)
            ring = self._read_rings.pop() if self._read_rings else None
        return slots, staged, ring

    def _end_reads(self, ring: "IoRing | None", broken: bool, bufs: dict, nkeys: int,
                   slots: "list[_Slot | None]", hits: set[int], verdicts: dict[int, str]) -> None:
        """End a demand read begun by :meth:`_begin_reads`: wait for reads still in flight (``bufs``:
        index -> buffer), give the ring back, count, and settle every leased slot (``hits``: served;
        ``verdicts``: index -> why it missed)."""
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
                self._settle_read(s, verdicts.get(i, ""), "read_errors_total")

    def describe(self, keys: Sequence[ObjectKey]) -> "list[tuple[int, int] | None]":
        """``(original length, segment length)`` of each key's readable object (published or pending),
        None when absent: what a caller needs to size destinations and bound a :meth:`read_many_device`
        window before reading anything."""
        out: list[tuple[int, int] | None] = []
        with self._lock:
            for k in keys:
                p = self._pending_segments.get(k)
                if p is not None:
                    _, original, stored, _ = _peek_segment(p[1])
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
        slots, staged, ring = begun
        on_device = self.device_io
        result: list[str | None] = ["absent"] * len(keys)
        verdicts: dict[int, str] = {}
        hits: set[int] = set()
        bufs: dict[int, Any] = {}  # reads in flight
        broken = False
        window_buf: Any = None
        try:
            todo = [(i, s.length if s is not None else record_length(len(staged[i])))
                    for i, s in enumerate(slots) if s is not None or i in staged]
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
            window_buf, arr = self._record_buffer(cap, on_device=on_device)
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
                        ring.prep_read(self._shards[s.shard].fid, view if on_device else window_buf[offs[i]:offs[i] + s.length],
                                       s.offset, i)
                        k += 1
                    for i, res in ring.submit_and_wait():
                        bufs.pop(i, None)
                        landed[i] = res
                ok = [i for i in reads if landed[i] == slots[i].length]
                for i in reads:
                    if landed[i] != slots[i].length:
                        verdicts[i] = _reason(landed[i], "short_read")
                heads = _heads(arr, [offs[i] for i in ok])
                deliver: list[tuple[int, Any]] = []
                for i, head in zip(ok, heads):
                    s = slots[i]
                    try:
                        verify_record_head(head, s.key.pack(), s.generation, s.stored)
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
        finally:
            self._end_reads(ring, broken, bufs, len(keys), slots, hits, verdicts)
            if window_buf is not None and not bufs:  # a buffer still in the kernel's hands is left alone
                self._recycle(window_buf)
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
        return result

    def _check_read(self, s: "_Slot", res: int, buf: memoryview, *,
                    keep: bool = False) -> "tuple[bytes | memoryview | None, str]":
        """A landed read of ``s``'s record (``res``: bytes read or -errno): its verified segment and "", or
        None and why (the short read or errno, or "corrupt"). ``buf`` goes back to the pool, unless
        ``keep``: the segment is then a view of ``buf``, which the caller recycles once done with it."""
        try:
            if res != s.length:
                return None, _reason(res, "short_read")
            try:
                seg = verify_record(buf, s.key.pack(), s.generation, s.stored)
                return (seg if keep else bytes(seg)), ""
            except SegmentError:
                return None, "corrupt"
        finally:
            if not keep:
                self._recycle(buf)

    def _settle_read(self, s: "_Slot", why: str, errors_counter: str) -> None:
        """A read of ``s`` ended (``why``: "" when it served or never ran): its lease goes, a corrupt
        record dies, an I/O error is counted under ``errors_counter``. Lock held."""
        s.leases -= 1
        if why == "corrupt":
            self._c["corrupt_records_total"] += 1
            self._kill(s)
        elif why:
            self._c[errors_counter] += 1
            self._errnos[why] += 1
        if s.wipe and not s.leases:
            self._queue_wipe(s)

    # -------------------------------------------------------------------------------------- prefetch

    def prefetch(self, keys: Sequence[ObjectKey], sink: Callable[[ObjectKey, bytes], None], *,
                 max_bytes: int | None = None) -> int:
        """Queue speculative reads of ``keys`` on the background lane; answer how many were queued.

        Each record that validates (the demand-read checks) is handed to ``sink(key, segment)`` on the
        lane's thread; an absent key is skipped, a corrupt record is invalidated and dropped like a demand
        miss, an I/O error drops the key. Never waits for I/O, and never delays demand reads: the lane
        starts no read while a demand read is in progress. Keys already queued, not published yet (their
        bytes are still in memory), or over ``max_bytes`` of records for this call or the lane's
        ``prefetch_max_bytes`` (counted as dropped) are skipped."""
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

    def _prefetch_lane(self) -> None:
        """The lane's thread: its own ring (prefetch_queue_depth), reads started only while no demand read
        is in progress, validated like demand reads, results to each request's sink. An I/O engine failure
        (the ring cannot be made or submitted to) ends the lane: its requests are dropped, their leases
        given back, and the next :meth:`prefetch` starts a new lane."""
        ring: IoRing | None = None
        inflight: dict[int, tuple[ObjectKey, int, Callable[[ObjectKey, bytes], None], _Slot, memoryview]] = {}
        batch: list[tuple[ObjectKey, int, Callable[[ObjectKey, bytes], None], _Slot]] = []
        tag = 0
        try:
            ring = self._io.ring(self.config.prefetch_queue_depth)
            while True:
                batch = []
                with self._lock:
                    while not inflight and not self._closed and (not self._pf_queue or self._demand):
                        self._pf_cond.wait(0.5)
                    if self._closed:  # queued requests go; reads in flight are waited for below
                        for k, length, _ in self._pf_queue:
                            self._pf_keys.discard(k)
                            self._pf_bytes -= length
                        self._pf_queue.clear()
                        if not inflight:
                            return
                    while not self._demand and self._pf_queue and ring.space() > len(batch):
                        k, length, sink = self._pf_queue.popleft()
                        s = self._index.get(k)
                        if s is None:  # evicted, invalidated or replaced since it was queued
                            self._pf_keys.discard(k)
                            self._pf_bytes -= length
                            self._c["prefetch_dropped_total"] += 1
                            continue
                        s.leases += 1
                        batch.append((k, length, sink, s))
                prepped = bool(batch)
                while batch:
                    k, length, sink, s = batch.pop()
                    tag += 1
                    buf = self._staging(s.length)
                    inflight[tag] = (k, length, sink, s, buf)
                    ring.prep_read(self._shards[s.shard].fid, buf, s.offset, tag)
                if prepped:
                    ring.submit()
                for t, res in ring.wait(0.05) if inflight else ():
                    k, length, sink, s, buf = inflight.pop(t)
                    seg, verdict = self._check_read(s, res, buf)
                    with self._lock:
                        self._pf_keys.discard(k)
                        self._pf_bytes -= length
                        if seg is not None:
                            self._c["prefetch_read_total"] += 1
                            self._c["prefetch_read_bytes_total"] += s.stored
                        self._settle_read(s, verdict, "prefetch_errors_total")
                    if seg is not None:
                        try:
                            sink(k, seg)
                        except Exception:  # the consumer's failure must not stop the lane
                            log.exception("SSD prefetch sink failed for %s", k)
        except SsdIoError as e:
            log.warning("SSD prefetch lane stopped: %s", e)
        finally:
            # Reads still in flight finish before their buffers and leases go (close waits for them);
            # prepped but never submitted ones die with the ring.
            if ring is not None:
                ring.close()
            with self._lock:
                left = [(k, length, s) for k, length, _, s, _ in inflight.values()]
                left += [(k, length, s) for k, length, _, s in batch]
                for k, length, s in left:
                    s.leases -= 1
                    if s.wipe and not s.leases:
                        self._queue_wipe(s)
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

    # -------------------------------------------------------------------------------------- admin

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, namespace: bytes | None = None,
                   all: bool = False) -> "TierCounts":
        """Hide matching records from readers at once (and writes in flight from being published);
        their header blocks are zeroed once unleased. Answers objects and stored bytes hidden."""
        from ...manager import TierCounts

        if keys is None and namespace is None and not all:
            raise ValueError("invalidate needs keys, a namespace or all=True")
        count = nbytes = 0
        with self._lock:
            want = set(keys) if keys is not None else None

            def match(k: ObjectKey) -> bool:
                return all or (want is not None and k in want) or (namespace is not None and k.namespace == namespace)

            for k in [k for k in self._pending_segments if match(k)]:
                del self._pending_segments[k]
            for sh in self._shards:
                for s in list(sh.slots.values()):
                    if s.zeroed or s.state is _State.WIPING or not match(s.key):
                        continue
                    if s.state is _State.COMMITTED and self._index.get(s.key) is s:
                        count += 1
                        nbytes += s.stored
                        self._c["invalidated_total"] += 1
                    if s.state is _State.WRITING:
                        s.wipe = True  # _complete() will not publish it and wipes it
                        continue
                    self._kill(s)
                    s.wipe = True
                    self._queue_wipe(s)
        return TierCounts(objects=count, bytes=nbytes)

    def iter_objects(self, namespace: bytes | None = None) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, stored_bytes)`` of every readable object (optionally of one namespace): the published
        records, then keys whose first write is still in flight (readable from memory, invariant 7)."""
        with self._lock:
            items = [(k, s.stored) for k, s in self._index.items() if namespace is None or k.namespace == namespace]
            items += [(k, len(seg)) for k, (_, seg) in self._pending_segments.items()
                      if k not in self._index and (namespace is None or k.namespace == namespace)]
        yield from items

    def iter_records(self, namespace: bytes | None = None) -> Iterator[SsdObject]:
        with self._lock:
            items = [s for k, s in self._index.items() if namespace is None or k.namespace == namespace]
        for s in items:
            yield SsdObject(s.key, s.stored, s.format, s.original, s.generation, s.shard, s.offset)

    def snapshot(self) -> SsdStats:
        with self._lock:
            c = self._c
            return SsdStats(
                capacity_bytes=sum(sh.capacity for sh in self._shards), shards=len(self._shards),
                backend=getattr(self._io, "name", type(self._io).__name__), objects=len(self._index),
                live_bytes=self._live, dead_bytes=self._dead, writing_bytes=self._writing,
                pending_bytes=self._pending_bytes, write_inflight_bytes=self._inflight_bytes,
                **{k: c[k] for k in (
                    "write_submitted_total", "write_completed_total", "write_bytes_total", "write_errors_total",
                    "write_dropped_total", "write_skipped_blocked_total", "write_cancelled_total",
                    "write_held_for_reads_total", "evicted_total", "evicted_bytes_total", "read_total", "read_hits_total", "read_bytes_total",
                    "read_errors_total", "read_pending_hits_total", "prefetch_requested_total",
                    "prefetch_read_total", "prefetch_read_bytes_total", "prefetch_dropped_total",
                    "prefetch_errors_total", "corrupt_records_total", "invalidated_total", "wipes_total",
                    "recovered_records", "recovered_torn_total", "recovered_corrupt_total",
                    "write_device_total", "write_device_bytes_total", "write_already_stored_total",
                    "read_device_total", "read_device_bytes_total")},
                read_latency_p50_seconds=_percentile(self._read_lat, 0.5),
                read_latency_p99_seconds=_percentile(self._read_lat, 0.99),
                write_latency_p50_seconds=_percentile(self._write_lat, 0.5),
                write_latency_p99_seconds=_percentile(self._write_lat, 0.99),
                errors_by_errno=dict(self._errnos),
            )

    def stats(self) -> dict[str, float]:
        """Flat ``ssd_*`` names for metrics (the Manager adds the ``orbitkv_`` prefix)."""
        d = asdict(self.snapshot())
        errs = d.pop("errors_by_errno")
        backend = d.pop("backend")
        out = {f"ssd_{k}": float(v) for k, v in d.items()}
        out[f"ssd_backend_{re.sub(r'[^a-z0-9]', '_', backend.lower())}"] = 1.0
        for k, v in errs.items():
            out[f"ssd_io_errors_{k.lower()}_total"] = float(v)
        return out

    def close(self) -> None:
        """Finish queued writes, stop the lane, close rings and files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pf_cond.notify_all()
            lane = self._pf_thread
        os.eventfd_write(self._wake, 1)
        self._writer.join()
        if lane is not None:
            lane.join()
        # A bulk submitter may still be in its _pump round on the writeback ring: wait for it, and keep
        # the ring lock for good, so that no later _pump drives (reaps) the ring once it is closed.
        self._ring_lock.acquire()
        self._wring.close()
        for r in self._read_rings:
            r.close()
        self._read_rings.clear()
        os.close(self._wake)
        self._io.close()

    def __enter__(self) -> "SsdTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
