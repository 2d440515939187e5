"""The SSD tier: ring logs of authenticated records over O_DIRECT shard files, an index of each key's newest
published record, a bounded io_uring writeback lane, demand reads that check every record, durable
invalidation, checkpoints and recovery.

Owns: the shard files (their superblocks, secrets, locks and syncs), the tier-wide generation counter,
checkpoints, invalidation, recovery and the tier's counters; the ring allocation lives in :mod:`.ring`,
the index in :mod:`.index`, the writeback lane in :mod:`.lane`, the read path in :mod:`.reads`, staging
buffers in :mod:`.staging`, the on-disk formats in :mod:`.record` and :mod:`.superblock`, the recovery
scan in :mod:`.recovery`.

Primitives (the Manager's :class:`~orbitkv_fs.manager.LowerTier` seam, plus a few for tools and tests):

* :meth:`SsdTier.submit` / :meth:`SsdTier.submit_device` (lane), :meth:`SsdTier.read` /
  :meth:`SsdTier.read_many` / :meth:`SsdTier.read_many_device` / :meth:`SsdTier.prefetch` (reads).
* :meth:`SsdTier.invalidate` -- hides the matching objects at once and answers only once that is durable:
  tombstone records are written and synced, and a checkpoint records them.
* :meth:`SsdTier.checkpoint` -- sync each shard and record in its superblock how far its log is durable
  (also every ``checkpoint_interval`` seconds, and at close).
* :meth:`SsdTier.contains`, :meth:`SsdTier.flush`, :meth:`SsdTier.iter_objects`,
  :meth:`SsdTier.listing` (a page of an admin listing), :meth:`SsdTier.iter_records`,
  :meth:`SsdTier.snapshot` (typed :class:`SsdStats`), :meth:`SsdTier.stats`
  (flat mapping), :meth:`SsdTier.close`.

Invariants:

1. A shard file is created mode 0600 and kept so; its superblock holds a random secret, and every record
   carries a keyed tag under it (see :mod:`.record`): KV content, which engines control, can never be
   read back as a record, a tombstone or a superblock. One process holds a shard file (``flock``).
2. Two-phase publish, bounded lane, demand reads first (:mod:`.lane`); every read checked (:mod:`.reads`).
3. An invalidation is durable when it answers: its tombstones (or, when none can be written, a raised
   floor in the superblock) are synced and checkpointed before :meth:`SsdTier.invalidate` returns, and
   recovery honours them. No header is wiped: the log stays a chain.
4. A checkpoint's generation ``W`` is written only after every record of the shard up to it ended and the
   file was synced: records at or below ``W`` are durable, and recovery treats their loss as damage.
5. Ephemeral by default (files truncated, a new secret); with ``recover`` each shard whose superblock
   verifies, matches the layout and whose file is private is recovered (:mod:`.recovery`), and the next
   record links to the end of its chain; any other shard starts empty under a new secret.
6. Generations are tier-wide, strictly increasing, at most ``GEN_MAX``; after a recovery they continue
   above every generation found or recorded.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import re
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ...errors import OrbitKVError
from ...keys import PACKED_SIZE, ObjectKey, page_of_chunks
from ...segment import Format, crc32c
from .index import SsdIndex
from .lane import WritebackLane, _Write
from .reads import ReadPath
from .record import (BLOCK, ENTRY_SIZE, GEN_MAX, MAX_RECORD, MAX_TOMBSTONE_BODY, NO_PREV, NO_TAG, Kind, Scope,
                     pack_record_header_into, record_length, tombstone_body, write_record_body)
from .recovery import ChainEnd, Fate, ShardFile, ShardIdentity, ShardRecovery, Status, recover_shard
from .ring import Shard, Slot, State
from .staging import StagingPool
from .superblock import RING_START, Superblock, copy_offset, new_secret, pack_superblock
from .uring import IoBackend, IoRing, SsdIoError, UringBackend

if TYPE_CHECKING:
    from ...manager import TierCounts

log = logging.getLogger(__name__)

#: The most writes the lane may have in flight (``--ssd-write-queue-depth``).
MAX_QUEUE_DEPTH = 1024
_LATENCY_SAMPLES = 4096


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
    #: Seconds between checkpoints (``--ssd-checkpoint-interval``): a crash can tear only records written
    #: since the last one (plus those in flight). 0: only at invalidation and clean close.
    checkpoint_interval: float = 1.0
    #: How long an invalidation waits for its tombstones (and the writes queued before them) to reach the
    #: disk; past it, the shard's floor is raised instead (everything older is never recovered).
    invalidate_timeout: float = 30.0
    #: Seconds a demand read waits with no read completing before it gives up (``--ssd-read-timeout``):
    #: its records miss and its shards are stalled (reads of them miss at once) until the disk answers.
    #: A hung disk then costs one reader this long, not every lookup forever. Below the vLLM connector's
    #: lookup timeout (5 s): a lookup over a hung disk answers (its DRAM hits counted) before the engine gives
    #: up on the Manager and stops asking it for a cool-down, DRAM hits and all.
    read_timeout: float = 2.0
    #: Seconds :meth:`SsdTier.close` waits for queued writes, the lanes and the checkpointer before it
    #: leaves a disk that does not answer as it is.
    close_timeout: float = 30.0

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
        if not self.checkpoint_interval >= 0:
            raise SsdConfigError("--ssd-checkpoint-interval must be >= 0 seconds")
        if not self.invalidate_timeout > 0:
            raise SsdConfigError("invalidate_timeout must be > 0 seconds")
        if not self.read_timeout > 0:
            raise SsdConfigError("--ssd-read-timeout must be > 0 seconds")
        if not self.close_timeout > 0:
            raise SsdConfigError("close_timeout must be > 0 seconds")


@dataclass(frozen=True)
class SsdStats:
    """A snapshot of the tier's counters (``_total``) and gauges."""

    capacity_bytes: int
    shards: int
    backend: str
    objects: int
    live_bytes: int  # records in the index
    dead_bytes: int  # superseded, invalidated, corrupt records and tombstones still occupying ring space
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
    #: Writes refused because the generation space is used up (never wrapped).
    write_generations_exhausted_total: int = 0
    #: Durability: tombstone records written; invalidations that raised a shard's floor instead (no room
    #: for a tombstone, its write failed or timed out); checkpoints written, and those that failed.
    tombstones_total: int = 0
    tombstone_fallbacks_total: int = 0
    checkpoints_total: int = 0
    checkpoint_errors_total: int = 0
    #: Recovery: verified records not adopted because they are off the chain (torn-write tails, older than
    #: where the chain ends) or covered by a tombstone or floor; shards whose chain ended in damage to a
    #: record the checkpoint called durable (nothing older adopted); blocks with the record magic that are
    #: not records (KV content, or damage); shards not recovered (no valid superblock, another layout, a
    #: file others could read); bytes the disk failed to read (EIO), read as zeros: damage.
    recovered_stale_total: int = 0
    recovered_invalidated_total: int = 0
    recovered_chain_breaks_total: int = 0
    recovered_unverified_blocks_total: int = 0
    recovered_shards_refused_total: int = 0
    recovered_unreadable_bytes_total: int = 0
    #: Records not read because their shard is stalled (a read of it timed out and the disk still holds
    #: it: ``read_timeout``); they miss at once. Shards stalled now.
    read_stalled_total: int = 0
    stalled_shards: int = 0
    #: Records dropped because their demand reads failed with an I/O error twice in a row (reads.UNREADABLE_AFTER).
    unreadable_records_dropped_total: int = 0


@dataclass(frozen=True)
class SsdObject:
    key: ObjectKey
    stored_bytes: int  # segment bytes (header + payload)
    format: Format
    original_length: int
    generation: int
    shard: int
    offset: int


def _percentiles(samples: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """The ``qs`` quantiles of ``samples`` (nearest rank below), by one partial sort: a metrics scrape holds the
    GIL for it, so not one full sort a quantile (40 us against 480 us for two of 4,096 samples)."""
    n = len(samples)
    if not n:
        return [0.0] * len(qs)
    at = [min(n - 1, int(q * n)) for q in qs]
    part = np.partition(samples, at)
    return [float(part[i]) for i in at]


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


_COUNTERS = tuple(f.name for f in SsdStats.__dataclass_fields__.values()
                  if f.name.endswith("_total") or f.name == "recovered_records")


class SsdTier(WritebackLane, ReadPath):
    """The SSD lower tier (see the module docstring). Thread-safe."""

    name = "ssd"

    def __init__(self, config: SsdConfig, *, backend: IoBackend | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        """``on_progress(bytes_done, bytes_total)``: called during a recovery scan (all shards together)."""
        self.config = config
        self._io = backend if backend is not None else make_backend(config.backend)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index = SsdIndex()
        self._c: collections.Counter[str] = collections.Counter()
        self._errnos: collections.Counter[str] = collections.Counter()
        self._read_lat: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._write_lat: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._writing = self._pending_bytes = 0
        self._queue: collections.deque[_Write] = collections.deque()
        self._inflight: dict[int, _Write] = {}
        self._inflight_bytes = 0
        # Idle buffers kept: as many as a full lane stages (its records' bytes, plus the classes' 1/8), so
        # that a lane filled again finds them all; new huge pages are zeroed as they are first written,
        # which held a DRAM eviction's demotions to a third of their rate on the development VM.
        self._staging = StagingPool(config.max_pending_bytes + config.max_pending_bytes // 8)
        # Lock order: _ckpt_lock, then _ring_lock, then _lock (the staging pool's own lock is innermost).
        self._ckpt_lock = threading.Lock()  # one checkpoint (sync + superblock write) at a time
        self._ring_lock = threading.Lock()  # one driver of the writeback ring at a time
        self._repump = False  # a _pump() call found the ring driven: the driver goes round once more
        self._submit_failed = False  # the last writeback submit raised: the next _pump submits again (_ring_lock)
        self._generation = 1
        self._exhausted_logged = False
        self._closed = False
        # Prefetch lane: (key, record bytes, sink) queued; its thread starts with the first request.
        self._pf_queue: collections.deque[tuple[ObjectKey, int, Callable[[ObjectKey, memoryview], None]]] = \
            collections.deque()
        self._pf_keys: set[ObjectKey] = set()  # queued or in flight
        self._pf_bytes = 0
        self._pf_cond = threading.Condition(self._lock)
        self._pf_thread: threading.Thread | None = None
        self._demand = 0  # demand reads in progress: the prefetch lane starts nothing meanwhile
        self._demand_until = 0.0  # perf_counter() until which writeback stays throttled after demand reads
        self._ckpt_cond = threading.Condition(self._lock)
        per_shard = config.capacity // len(config.paths) // BLOCK * BLOCK
        self._shards: list[Shard] = []
        try:
            self._open_shards(per_shard, on_progress)
            self._wring = self._io.ring(config.write_queue_depth)
        except BaseException:
            self._io.close()
            for sh in self._shards:
                os.close(sh.sb_fd)
            raise
        self._read_rings: list[IoRing] = []
        self._stuck: list = []  # demand reads given up on a stalled disk (reads._Stuck)
        self._stuck_lock = threading.Lock()
        self._stalled: set[int] = set()  # shards with reads given up on still in the kernel's hands
        self._close_done = threading.Event()
        self._read_failures: dict = {}  # Slot -> demand reads of it that failed in a row (reads.UNREADABLE_AFTER)
        self._close_error: BaseException | None = None
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # A wake-up is written and not yet consumed: further kicks need no system call (see _kick).
        self._wake_pending = False
        self._bulk_until = 0.0  # perf_counter until which a bulk submitter (submit with a timeout) drives the ring
        self._writer = threading.Thread(target=self._writeback, name="orbitkv-ssd-writeback", daemon=True)
        self._writer.start()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="orbitkv-ssd-checkpoint",
                                              daemon=True)
        self._checkpointer.start()

    # -------------------------------------------------------------------------------------- shard files

    def _open_shards(self, per_shard: int, on_progress: Callable[[int, int], None] | None) -> None:
        """Open, lock and (re)initialise or recover every shard file."""
        n = len(self.config.paths)
        recovered: list[ShardRecovery | None] = []
        done = [0]
        total = n * (per_shard - RING_START)

        # One progress over all shards: each shard's scan reports its own bytes.
        progress = None if on_progress is None else (lambda d, _t: on_progress(done[0] + d, total))

        for i, path in enumerate(self.config.paths):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise SsdIoError(f"cannot open {path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise SsdIoError(f"{path} is in use by another process (its lock is held)") from None
            private = not (os.fstat(fd).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
            try:
                os.fchmod(fd, 0o600)
                fid = self._io.open(path, per_shard, truncate=not self.config.recover)
            except OSError as e:
                os.close(fd)
                raise SsdIoError(f"cannot make {path} private: {e.strerror}") from None
            except BaseException:
                os.close(fd)
                raise
            rec = None
            if self.config.recover:
                if private:
                    rec = self._scan_shard(fd, i, n, per_shard, progress)
                else:  # others could have read its secret: nothing in it is trusted
                    log.warning("SSD shard %s was readable by other users: not recovered", path)
                done[0] += per_shard - RING_START
            sb = rec.superblock if rec is not None and not rec.problem else None
            if self.config.recover and sb is None:
                self._c["recovered_shards_refused_total"] += 1
                if rec is not None:
                    log.warning("SSD shard %s not recovered: %s", path, rec.problem)
            self._shards.append(Shard(i, path, fid, per_shard, sb.secret if sb is not None else new_secret(), fd))
            recovered.append(rec if sb is not None else None)
        for sh, rec in zip(self._shards, recovered):
            if rec is not None:
                self._adopt(sh, rec)
        for sh, rec in zip(self._shards, recovered):
            if rec is None:
                self._initialise(sh)
            else:
                self._write_superblock(sh, sh.sequence + 1)

    def _scan_shard(self, fd: int, index: int, count: int, capacity: int,
                    on_progress: Callable[[int, int], None] | None) -> ShardRecovery:
        size = min(os.fstat(fd).st_size, capacity)
        if size < RING_START:
            return recover_shard(b"", expect=ShardIdentity(index, count, capacity))
        rec = recover_shard(ShardFile(fd, size), expect=ShardIdentity(index, count, capacity), on_progress=on_progress)
        if rec.unreadable:
            n = sum(length for _, length in rec.unreadable)
            self._c["recovered_unreadable_bytes_total"] += n
            log.warning("SSD shard %s: %d bytes in %d ranges could not be read (first at offset %d); the records "
                        "in them are not recovered", self.config.paths[index], n, len(rec.unreadable),
                        rec.unreadable[0][0])
        return rec

    def _adopt(self, sh: Shard, rec: ShardRecovery) -> None:
        """Serve ``rec``'s live records again; the next record of ``sh`` links to the end of its chain."""
        sb = rec.superblock
        assert sb is not None
        c = self._c
        for r in rec.records:
            c["recovered_torn_total"] += r.status is Status.TORN
            c["recovered_corrupt_total"] += r.status is Status.CORRUPT
            c["recovered_stale_total"] += r.fate is Fate.STALE
            c["recovered_invalidated_total"] += r.fate is Fate.INVALIDATED
            if r.fate is not Fate.LIVE:
                continue
            h, seg = r.header, r.segment
            assert h.key is not None and seg is not None
            slot = Slot(sh.index, h.offset, h.record_length, h.key, h.generation, h.body_length, seg.format,
                        seg.original_length, seg.payload_crc)
            slot.done = True
            old = self._index.get(h.key)
            if old is not None and old.generation > h.generation:  # the same key in two shards: newest wins
                continue
            sh.insert(slot)
            if old is not None:
                self._shards[old.shard].remove(old)
                self._index.release(old)
            self._index.publish(slot)
        c["recovered_unverified_blocks_total"] += rec.unverified_blocks
        if rec.chain_end is ChainEnd.BREAK or rec.cut:
            c["recovered_chain_breaks_total"] += 1
            log.warning("SSD shard %s: %s; older records are not recovered", sh.path,
                        rec.cut or f"a durable record at offset {rec.break_offset} is missing or damaged")
        sh.sequence = sb.sequence
        sh.floor = sb.floor
        if rec.head is not None:
            h = rec.head
            sh.last_offset, sh.last_tag = h.offset, h.tag
            sh.front = (h.generation, h.offset, h.tag)
            sh.head = h.end if h.end < sh.capacity else RING_START
        else:  # a new log: nothing from before may ever be taken for part of it
            sh.floor = max(sh.floor, rec.next_generation - 1)
        self._generation = max(self._generation, rec.next_generation)
        c["recovered_records"] = len(self._index)
        log.info("SSD shard %s recovered: %d records live, chain ends: %s", sh.path,
                 sum(r.fate is Fate.LIVE for r in rec.records), rec.chain_end.value)

    def _initialise(self, sh: Shard) -> None:
        """A fresh shard (a new secret, chosen when it was opened): two superblock copies, an empty log."""
        self._write_superblock(sh, 1, sync=False)
        self._write_superblock(sh, 2)

    def _write_superblock(self, sh: Shard, sequence: int, front: tuple[int, int, bytes] | None = None, *,
                          sync: bool = True) -> None:
        """Write ``sh``'s superblock of ``sequence`` (``front``, by default its durable front now; its floor
        and the generations used so far) and sync it. The caller synced the records ``front`` covers."""
        with self._lock:
            gen, off, tag = sh.front if front is None else front
            sb = Superblock(sh.index, len(self.config.paths), sh.capacity, sequence, sh.secret,
                            gen, off if gen else NO_PREV, tag if gen else NO_TAG, sh.floor,
                            min(max(self._generation - 1, gen, sh.floor), GEN_MAX))
        os.pwrite(sh.sb_fd, pack_superblock(sb), copy_offset(sequence))
        if sync:
            os.fdatasync(sh.sb_fd)
        sh.sequence = sequence
        sh.checkpointed = gen

    # -------------------------------------------------------------------------------------- checkpoints

    def checkpoint(self, shards: "Sequence[Shard] | None" = None) -> None:
        """Sync each shard and record in its superblock the newest record up to which every write ended
        (and its floor): what a later recovery may call durable. Raises :class:`SsdIoError` when a shard
        cannot be synced or its superblock written."""
        with self._ckpt_lock:
            for sh in self._shards if shards is None else shards:
                with self._lock:
                    front = sh.front  # every write up to it ended: the sync below makes them durable
                try:
                    # The records the front covers reach stable storage before the superblock names them.
                    os.fdatasync(sh.sb_fd)
                    self._write_superblock(sh, sh.sequence + 1, front)
                except OSError as e:
                    with self._lock:
                        self._c["checkpoint_errors_total"] += 1
                    raise SsdIoError(f"checkpoint of {sh.path} failed: {e.strerror}") from None
                with self._lock:
                    self._c["checkpoints_total"] += 1

    def _checkpoint_loop(self) -> None:
        """Every ``checkpoint_interval`` seconds, checkpoint the shards whose durable front moved."""
        interval = self.config.checkpoint_interval
        if interval <= 0:
            return
        while True:
            with self._lock:
                self._ckpt_cond.wait(interval)
                if self._closed:
                    return
                due = [sh for sh in self._shards if sh.front[0] > sh.checkpointed]
            if due:
                try:
                    self.checkpoint(due)
                except SsdIoError as e:
                    log.warning("SSD %s", e)

    # -------------------------------------------------------------------------------------- invalidation

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, namespace: bytes | None = None,
                   chunks: Sequence[bytes] | None = None, all: bool = False) -> "TierCounts":
        """Hide the matching objects from readers at once (and writes in flight from being published), and
        answer once that is durable: tombstones for ``keys``, the ``chunks`` of ``namespace`` (16-byte
        chunk keys) or all of ``namespace`` are written to the shards and synced, with every write queued
        before them, and a checkpoint records them; ``all`` raises every shard's floor. A tombstone that
        cannot be written in time raises its shard's floor instead (older records of every key are then
        never recovered). Answers the objects and stored bytes hidden. Raises :class:`SsdIoError` when a
        shard cannot be synced (the invalidation is then in effect here but not durable)."""
        from ...manager import TierCounts

        if (keys is not None) + (namespace is not None) + bool(all) != 1 or (chunks is not None and namespace is None):
            raise ValueError("invalidate needs keys, a namespace (optionally with chunks) or all=True")
        if namespace is not None and len(namespace) != 16 or chunks is not None and any(len(c) != 16 for c in chunks):
            raise ValueError("a namespace and a chunk key are 16 bytes each")
        want = set(keys) if keys is not None else None
        wanted = {namespace + c for c in chunks} if chunks is not None else None

        def match(k: ObjectKey) -> bool:
            if want is not None:
                return k in want
            if wanted is not None:
                return k.namespace + k.chunk in wanted
            return all or k.namespace == namespace

        staged = [] if all else self._stage_tombstones(keys, namespace, chunks)
        count = nbytes = 0
        tombs: list[Slot] = []
        # Keys and chunks visit their chunks' records only (an engine may invalidate its own chunks as often
        # as it likes), a namespace its own chunks' (one test a chunk, not every record of a shared cache);
        # everything, every record.
        prefixes = ({k.namespace + k.chunk for k in want} if want is not None else wanted)
        with self._lock:
            if prefixes is None and not all:
                prefixes = {p for sh in self._shards for p in sh.by_chunk if p[:16] == namespace}
            for k in [k for k in self._index.pending if match(k)]:
                del self._index.pending[k]
            for sh in self._shards:
                visit = sh.chunk_slots(prefixes) if prefixes is not None else list(sh.slots.values())
                for s in visit:
                    if s.is_tombstone or not match(s.key):  # type: ignore[arg-type]
                        continue
                    if s.state is State.COMMITTED and self._index.get(s.key) is s:  # type: ignore[arg-type]
                        count += 1
                        nbytes += s.stored
                        self._c["invalidated_total"] += 1
                    if s.state is State.WRITING:
                        s.cancel = True  # _complete() will not publish it
                    else:
                        self._index.kill(s)
            if self._closed:
                for _, _, _, buf, _ in staged:
                    self._staging.recycle(buf)
                return TierCounts(objects=count, bytes=nbytes)
            targets = set(range(len(self._shards))) if all or namespace is not None else {i for i, *_ in staged}
            if all:
                for sh in self._shards:
                    sh.floor = max(sh.floor, self._generation - 1)
            for i, scope, key_field, buf, body_len in staged:
                sh = self._shards[i]
                slot = self._place(sh, None, len(buf), body_len, None, 0, 0, buf, 5.0)
                if slot is None:
                    self._fall_back(sh, self._generation - 1)
                    continue
                sh.append(slot, pack_record_header_into(buf, sh.key, Kind.TOMBSTONE, key_field, slot.generation,
                                                        body_len, slot.offset, *sh.link(), scope))
                self._queue_write(slot, buf)
                tombs.append(slot)
        if tombs:
            self._start(1.0)  # drive the lane from here: the answer waits for these writes
        deadline = time.monotonic() + self.config.invalidate_timeout
        with self._lock:
            for t in tombs:
                sh = self._shards[t.shard]
                while sh.front[0] < t.generation and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._idle.wait(min(left, 0.05))
                if t.failed or sh.front[0] < t.generation:
                    self._fall_back(sh, t.generation)
        self.checkpoint([self._shards[i] for i in sorted(targets)])
        return TierCounts(objects=count, bytes=nbytes)

    def _fall_back(self, sh: Shard, floor: int) -> None:
        """No tombstone made it: nothing of ``sh`` up to ``floor`` may ever be recovered. Lock held."""
        sh.floor = max(sh.floor, floor)
        self._c["tombstone_fallbacks_total"] += 1

    def _stage_tombstones(self, keys: Sequence[ObjectKey] | None, namespace: bytes | None,
                          chunks: Sequence[bytes] | None) -> list[tuple[int, Scope, bytes, memoryview, int]]:
        """The tombstones of an invalidation, staged: ``(shard, scope, key field, buffer, body length)``.
        Keys go to their own shard; chunks and namespaces to every shard (a chunk's keys spread over all)."""
        per_shard: list[tuple[int, Scope, bytes, list[bytes]]] = []
        n = len(self._shards)
        if keys is not None:
            groups: dict[int, list[bytes]] = collections.defaultdict(list)
            for k in set(keys):
                groups[self._shard_of(k).index].append(k.pack())
            per_shard = [(i, Scope.KEYS, bytes(PACKED_SIZE), sorted(g)) for i, g in sorted(groups.items())]
        elif chunks is not None:
            entries = sorted({namespace + c for c in chunks})  # type: ignore[operator]
            per_shard = [(i, Scope.CHUNKS, bytes(PACKED_SIZE), entries) for i in range(n)] if entries else []
        else:
            field_ = namespace + bytes(PACKED_SIZE - 16)  # type: ignore[operator]
            per_shard = [(i, Scope.NAMESPACE, field_, []) for i in range(n)]
        staged = []
        for i, scope, key_field, entries in per_shard:
            step = max(1, MAX_TOMBSTONE_BODY // max(ENTRY_SIZE[scope], 1))
            for j in range(0, max(len(entries), 1), step):
                body = tombstone_body(scope, entries[j:j + step])
                buf = self._staging.host(record_length(len(body)))
                write_record_body(buf, body)
                staged.append((i, scope, key_field, buf, len(body)))
        return staged

    # -------------------------------------------------------------------------------------- the rest

    def _shard_of(self, key: ObjectKey) -> Shard:
        return self._shard_of_packed(key.pack())

    def _shard_of_packed(self, packed: bytes) -> Shard:
        return self._shards[crc32c(packed) % len(self._shards)]

    @property
    def device_io(self) -> bool:
        """The backend moves device memory itself (cuFile): :meth:`submit_device` and
        :meth:`read_many_device` then never bounce through host memory."""
        return getattr(self._io, "name", "") == "cufile"

    def iter_objects(self, namespace: bytes | None = None) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, stored_bytes)`` of every readable object (optionally of one namespace): the published
        records, then keys whose first write is still in flight (readable from memory)."""
        with self._lock:
            items = [(k, s.stored) for k, s in self._index.items() if namespace is None or k.namespace == namespace]
            items += [(k, len(seg)) for k, (_, seg) in self._index.pending.items()
                      if k not in self._index and (namespace is None or k.namespace == namespace)]
        yield from items

    def listing(self, match_chunk: Callable[[bytes], bool] | None = None, after: bytes = b"",
                limit: int | None = None) -> list[tuple[bytes, int]]:
        """``(packed key, stored bytes)`` of the readable objects (as :meth:`iter_objects`) whose key sorts after
        ``after``, of the chunks whose 32-byte prefix (namespace + chunk) ``match_chunk``es (all without it),
        sorted by key: the first ``limit`` of them (at least; all without it). Chunk by chunk in prefix order,
        through each shard's records by chunk, so that a page of an admin listing builds its own chunks' rows
        under the tier's lock, not every record's key and a sort of them all (every read, demotion and lookup
        waits on that lock)."""
        with self._lock:
            index = self._index
            pending: dict[bytes, list[tuple[bytes, int]]] = {}
            for k, (_, seg) in index.pending.items():
                if k not in index:
                    pending.setdefault(k.namespace + k.chunk, []).append((k.pack(), len(seg)))
            prefixes = set(pending)
            for sh in self._shards:
                prefixes.update(sh.by_chunk)
            return page_of_chunks(prefixes, lambda p: [(s.key.pack(), s.stored)  # type: ignore[union-attr]
                                                       for sh in self._shards for s in sh.chunk_records(p)
                                                       if index.get(s.key) is s] + pending.get(p, []),
                                  after, limit, match_chunk)

    def iter_records(self, namespace: bytes | None = None) -> Iterator[SsdObject]:
        with self._lock:
            items = [s for k, s in self._index.items() if namespace is None or k.namespace == namespace]
        for s in items:
            yield SsdObject(s.key, s.stored, s.format, s.original, s.generation, s.shard,  # type: ignore[arg-type]
                            s.offset)

    def snapshot(self) -> SsdStats:
        with self._lock:  # the latencies are copied under the lock and ranked after it
            c = self._c
            fields = dict(
                capacity_bytes=sum(sh.capacity for sh in self._shards), shards=len(self._shards),
                backend=getattr(self._io, "name", type(self._io).__name__), objects=len(self._index),
                live_bytes=self._index.live, dead_bytes=self._index.dead, writing_bytes=self._writing,
                pending_bytes=self._pending_bytes, write_inflight_bytes=self._inflight_bytes,
                stalled_shards=len(self._stalled), **{k: c[k] for k in _COUNTERS}, errors_by_errno=dict(self._errnos))
            reads = np.fromiter(self._read_lat, np.float64)
            writes = np.fromiter(self._write_lat, np.float64)
        r50, r99 = _percentiles(reads, (0.5, 0.99))
        w50, w99 = _percentiles(writes, (0.5, 0.99))
        return SsdStats(**fields, read_latency_p50_seconds=r50, read_latency_p99_seconds=r99,
                        write_latency_p50_seconds=w50, write_latency_p99_seconds=w99)

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
        """Finish queued writes, stop the lanes, checkpoint every shard, close rings and files. Idempotent.
        A disk that does not let that finish within ``close_timeout`` does not hold the caller: the close
        returns and goes on in the background (:meth:`wait_closed`) until the disk answers; a process that
        exits meanwhile leaves its I/O to the kernel, and a restart recovers up to the last checkpoint."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pf_cond.notify_all()
            self._ckpt_cond.notify_all()
            lane = self._pf_thread
        os.eventfd_write(self._wake, 1)
        threads = [t for t in (self._writer, lane, self._checkpointer) if t is not None]
        # The rest runs on a thread of its own, so that a disk that stops answering (a write, a sync that
        # never returns) holds only that thread.
        closer = threading.Thread(target=self._finish_close, args=(threads,), name="orbitkv-ssd-close", daemon=True)
        closer.start()
        if self._close_done.wait(self.config.close_timeout):
            if self._close_error is not None:
                raise self._close_error
            return
        busy = [t.name for t in threads if t.is_alive()] + ["reads given up on"] * bool(self._stuck)
        log.error("SSD: the disk did not answer within %.0f s of closing (%s): the close goes on in the "
                  "background; if the process exits first, a restart recovers up to the last checkpoint",
                  self.config.close_timeout, ", ".join(busy or ["the final checkpoint"]))

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Whether :meth:`close` finished (files closed, shard locks released), waiting up to ``timeout``."""
        return self._close_done.wait(timeout)

    def _finish_close(self, threads: list[threading.Thread]) -> None:
        try:
            self._close_files(threads)
        except BaseException as e:  # handed to close() when it still waits, logged otherwise
            self._close_error = e
            log.error("SSD: closing failed: %s", e)
        finally:
            self._close_done.set()

    def _close_files(self, threads: list[threading.Thread]) -> None:
        for t in threads:
            t.join()
        with self._stuck_lock:  # reads given up on: their buffers stay until the kernel is done with them
            for st in self._stuck:
                while st.reads:
                    for tag, _ in st.ring.wait(1.0):
                        st.reads.pop(tag, None)
                st.ring.close()
            self._stuck.clear()
        try:  # a clean close: everything written is durable
            self.checkpoint()
        except SsdIoError as e:
            log.warning("SSD %s", e)
        # A bulk submitter may still be in its _pump round on the writeback ring: wait for it, and keep
        # the ring lock for good, so that no later _pump drives (reaps) the ring once it is closed.
        self._ring_lock.acquire()
        self._wring.close()
        for r in self._read_rings:
            r.close()
        self._read_rings.clear()
        os.close(self._wake)
        self._io.close()
        for sh in self._shards:
            os.close(sh.sb_fd)  # releases the shard's lock

    def __enter__(self) -> "SsdTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
