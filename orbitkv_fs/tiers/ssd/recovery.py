"""The recovery scan: which records of a shard image a restart may serve again. Shared by
``SsdTier(recover=True)`` and ``orbitkv-inspect``; works on a shard file (:class:`ShardFile`) or any buffer.

A shard file is read with ``pread``, a window at a time, never mapped: a block the disk cannot read (EIO)
reads as zeros and is listed, where a page fault on it in an mmap would kill the process with SIGBUS (and a
Manager started with ``--ssd-recover`` would die at every start). Zeros are never record magic and fail every
CRC, so an unreadable block is damage to the scan like any other: a record in it is not adopted.

Three steps:

1. **Superblock.** The current copy (:func:`~.superblock.read_superblocks`) gives the shard's secret, its
   layout and its checkpoint (generation ``W``, head record, floor). No valid superblock, or one of another
   layout: nothing is recovered.
2. **Scan.** Every block whose first bytes are the record magic is a candidate only when its header parses,
   its tag verifies under the secret, it names its own offset and fits the ring. Every other block is
   payload or damage and is never read as metadata (counted as ``unverified_blocks``). Each candidate's
   body is checked in full (segment: header, lengths, payload CRC32C, layer/role against the key;
   tombstone: head and entries CRC32C).
3. **Chain.** Each record links to the previous record of its shard's log (offset and tag). Recovery
   takes the chain walked back from the newest *anchored* record: one whose links reach the first record
   of the log, records the ring overwrote since, the floor, or the checkpoint head. A missing link between
   records newer than ``W`` is a write the crash tore: the records after it are not anchored (dropped),
   the walk takes the next newest record. A missing link at or below ``W`` (the checkpoint says that
   record was durable) is damage: the walk ends there and nothing older is adopted (older records could be
   stale versions the damage would expose). Then, newest first along the chain: a tombstone invalidates
   every older record of its scope (a damaged tombstone ends adoption), the first record of a key decides
   it (a damaged one shadows older versions), the rest are superseded.

Primitives: :func:`recover_shard` -> :class:`ShardRecovery` (every verified record as a
:class:`RecordInfo` with its :class:`Status` and :class:`Fate`, the chain's end, what to link the next
record to, the next generation).

Invariants: a record is adopted only if its tag verified, it lies on the chain, no tombstone or floor
covers it, no newer record of its key lies on the chain, and its body checked in full; recovery never
raises for any bytes (every parse failure is a typed error it classifies).
"""

from __future__ import annotations

import bisect
import enum
import hmac
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from sortedcontainers import SortedList

from ...errors import SegmentError
from ...segment import SegmentHeader
from .record import (BLOCK, MAGIC, MAX_RECORD, NO_PREV, RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, Kind, RecordHeader,
                     Scope, ShardKey, Tombstone, check_segment_body, parse_record_header, parse_tombstone,
                     verify_record_tag)
from .superblock import RING_START, Superblock, read_superblocks

#: ``on_progress(bytes_done, bytes_total)`` this often during the scan (one numpy pass over its blocks each).
PROGRESS_EVERY = 8 << 20


class Status(enum.Enum):
    """The integrity of a verified record's body."""

    VALID = "valid"
    CORRUPT = "corrupt"  # a body that does not check, at or below the checkpoint (was durable: damage)
    TORN = "torn"  # the same above the checkpoint: a write the crash interrupted


class Fate(enum.Enum):
    """What recovery does with a verified record."""

    LIVE = "live"  # served again
    SUPERSEDED = "superseded"  # a newer record of its key lies on the chain
    INVALIDATED = "invalidated"  # a newer tombstone on the chain covers it
    DAMAGED = "damaged"  # the newest record of its key on the chain, and its body does not check
    TOMBSTONE = "tombstone"  # a tombstone on the chain
    STALE = "stale"  # not on the chain (older than where it ends, or after a torn write), or cut off


class ChainEnd(enum.Enum):
    EMPTY = "empty"  # no record is anchored
    ROOT = "root"  # the first record of the log
    OVERWRITTEN = "overwritten"  # older records were overwritten by the ring
    FLOOR = "floor"  # older records are below the floor (invalidated)
    BREAK = "break"  # a record the checkpoint says was durable is missing or damaged: nothing older adopted


@dataclass(slots=True)
class RecordInfo:
    header: RecordHeader
    status: Status
    fate: Fate = Fate.STALE
    segment: SegmentHeader | None = None
    tombstone: Tombstone | None = None
    error: str = ""

    @property
    def offset(self) -> int:
        return self.header.offset


@dataclass
class ShardRecovery:
    superblock: Superblock | None
    superblock_errors: list[str]
    problem: str = ""  # why nothing could be recovered, "" otherwise
    records: list[RecordInfo] = field(default_factory=list)  # every verified record, in file order
    chain: list[RecordInfo] = field(default_factory=list)  # the records on the chain, newest first
    chain_end: ChainEnd = ChainEnd.EMPTY
    break_offset: int | None = None  # ChainEnd.BREAK: where the missing durable record should be
    cut: str = ""  # why adoption stopped before the chain's end (a damaged tombstone)
    unverified_blocks: int = 0  # record magic at a block start, header or tag not verifying
    head: RecordHeader | None = None  # the newest record on the chain: the next record links to it
    next_generation: int = 1
    scanned_bytes: int = 0
    unreadable: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) the disk failed to read

    @property
    def live(self) -> list[RecordInfo]:
        return [r for r in self.records if r.fate is Fate.LIVE]


@dataclass(frozen=True)
class ShardIdentity:
    """What a tier expects of a shard: its place in the layout (the superblock must agree) and the end
    of its ring now."""

    index: int
    count: int
    capacity: int


_ROOT, _OVERWRITTEN, _MISSING = "root", "overwritten", "missing"


class ShardFile:
    """A shard file as the scan reads it: :meth:`read` answers a range, the blocks the disk failed to read
    as zeros (:attr:`unreadable`). ``fd`` stays the caller's."""

    def __init__(self, fd: int, size: int | None = None) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size if size is None else size
        self._bad: set[int] = set()  # block offsets
        os.posix_fadvise(fd, 0, self.size, os.POSIX_FADV_SEQUENTIAL)  # the scan reads it front to back once

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, length: int, into: bytearray | None = None) -> memoryview:
        """``length`` bytes from ``offset`` (fewer past the file's end), in ``into`` when given (a buffer the
        caller reuses: a window of the scan) or in a new one."""
        length = max(0, min(length, self.size - offset))
        buf = bytearray(length) if into is None or len(into) < length else into
        try:
            self._read_into(memoryview(buf), offset)
        except OSError:  # somewhere in the range the disk fails: read it block by block, keep what reads
            mv = memoryview(buf)
            for lo in range(offset - offset % BLOCK, offset + length, BLOCK):
                a, b = max(lo, offset), min(lo + BLOCK, offset + length)
                try:
                    self._read_into(mv[a - offset:b - offset], a)
                except OSError:
                    mv[a - offset:b - offset] = bytes(b - a)
                    self._bad.add(lo)
        return memoryview(buf)[:length]

    def _read_into(self, mv: memoryview, offset: int) -> None:
        done = 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:]], offset + done)
            if n == 0:  # the file ended (it shrank under us): the rest reads as zeros
                mv[done:] = bytes(len(mv) - done)
                return
            done += n

    @property
    def unreadable(self) -> list[tuple[int, int]]:
        """The ranges (offset, length) whose blocks failed to read, merged, in file order."""
        out: list[tuple[int, int]] = []
        for b in sorted(self._bad):
            if out and out[-1][0] + out[-1][1] == b:
                out[-1] = (out[-1][0], out[-1][1] + BLOCK)
            else:
                out.append((b, BLOCK))
        return out


class _Buffer:
    """A shard image already in memory (bytes, a memoryview, an mmap), read as :class:`ShardFile` reads."""

    def __init__(self, image: "bytes | memoryview") -> None:
        self.mv = image.cast("B") if isinstance(image, memoryview) else memoryview(image)
        self.unreadable: list[tuple[int, int]] = []  # memory does not fail a read

    def __len__(self) -> int:
        return len(self.mv)

    def read(self, offset: int, length: int, into: bytearray | None = None) -> memoryview:
        return self.mv[offset:offset + length]


def recover_shard(image: "ShardFile | bytes | memoryview", *, expect: ShardIdentity | None = None,
                  on_progress: Callable[[int, int], None] | None = None) -> ShardRecovery:
    """Classify every record of a shard image and decide what a restart serves (see the module docstring)."""
    img = image if isinstance(image, ShardFile) else _Buffer(image)
    out = _recover(img, expect, on_progress)
    out.unreadable = img.unreadable
    return out


def _recover(img: "ShardFile | _Buffer", expect: ShardIdentity | None,
             on_progress: Callable[[int, int], None] | None) -> ShardRecovery:
    sb, errors = read_superblocks(img.read(0, RING_START))
    out = ShardRecovery(sb, errors)
    if sb is None:
        out.problem = "no valid superblock"
        return out
    if expect is not None and (sb.shard_index, sb.shard_count) != (expect.index, expect.count):
        # Keys are spread over shards by their hash modulo the count: another layout puts them elsewhere,
        # and a tombstone written to one shard would not cover a key's records in another.
        out.problem = (f"the superblock describes shard {sb.shard_index} of {sb.shard_count}; expected shard "
                       f"{expect.index} of {expect.count}")
        return out
    key = ShardKey(sb.secret)
    # The ring ends where the tier now says (a resized cache keeps what fits), or where it ended.
    _scan(img, sb, expect.capacity if expect is not None else sb.capacity, key, out, on_progress)
    _walk(sb, out)
    _adopt(sb, out)
    gens = [r.header.generation for r in out.records]
    out.next_generation = max(gens + [sb.generations, sb.floor, sb.checkpoint_generation]) + 1
    return out


def _scan(img: "ShardFile | _Buffer", sb: Superblock, capacity: int, key: ShardKey, out: ShardRecovery,
          on_progress: Callable[[int, int], None] | None) -> None:
    limit = min(len(img), capacity)
    size = limit - limit % BLOCK
    out.scanned_bytes = total = max(size - RING_START, 0)
    buf = bytearray(min(PROGRESS_EVERY, total))
    for lo in range(RING_START, size, PROGRESS_EVERY):
        if on_progress is not None:
            on_progress(lo - RING_START, total)
        # Every block is looked at, also inside a record: a newer record torn by a crash can leave an older
        # record's header whole inside its extent, and only the chain says which of them counts.
        hi = min(lo + PROGRESS_EVERY, size)
        window = img.read(lo, hi - lo, buf)
        for off in _magic_blocks(window, 0, hi - lo):
            info = _candidate(img, window, lo, lo + off, size, capacity, sb, key)
            if info is None:
                out.unverified_blocks += 1
            else:
                out.records.append(info)
    if on_progress is not None:
        on_progress(total, total)


_MAGIC_WORD = int.from_bytes(MAGIC, "little")


def _magic_blocks(mv: memoryview, lo: int, hi: int) -> list[int]:
    """The offsets of the blocks in ``[lo, hi)`` (block-aligned) that begin with the record magic: one strided
    read of each block's first word. A search for the magic through every byte read each payload once more
    than its CRC does, and was most of the scan's time."""
    words = np.ndarray(((hi - lo) // BLOCK,), dtype="<u4", buffer=mv, offset=lo, strides=(BLOCK,))
    return (np.flatnonzero(words == _MAGIC_WORD) * BLOCK + lo).tolist()


def _candidate(img: "ShardFile | _Buffer", window: memoryview, lo: int, off: int, size: int, capacity: int,
               sb: Superblock, key: ShardKey) -> RecordInfo | None:
    """The verified record at ``off`` (inside ``window``, the image from ``lo``), or None (not a record this
    shard's log wrote there)."""
    head = window[off - lo:off - lo + RECORD_HEAD_BYTES]  # whole: windows end block-aligned
    try:
        rh = parse_record_header(head)
        verify_record_tag(head, key)
    except SegmentError:
        return None
    if rh.offset != off or rh.end > capacity:
        return None
    a, b = off + RECORD_HEADER_SIZE, min(off + RECORD_HEADER_SIZE + rh.body_length, size)
    body = window[a - lo:b - lo] if b <= lo + len(window) else img.read(a, b - a)
    info = RecordInfo(rh, Status.VALID)
    try:
        if rh.kind is Kind.SEGMENT:
            info.segment = check_segment_body(rh, body)
        else:
            info.tombstone = parse_tombstone(rh, body)
    except SegmentError as e:
        info.status = Status.TORN if rh.generation > sb.checkpoint_generation else Status.CORRUPT
        info.error = f"{type(e).__name__}: {e}"
    return info


class _Records:
    """The verified records by offset, with the two questions the walk asks of them."""

    def __init__(self, records: list[RecordInfo]) -> None:
        self.by_offset = {r.offset: r for r in records}
        self.offsets = sorted(self.by_offset)

    def link(self, r: RecordInfo) -> "RecordInfo | str":
        """The record ``r`` links to, or why there is none: the first record of the log (_ROOT), a place a
        newer record has taken since (_OVERWRITTEN), or a record that is not there (_MISSING)."""
        h = r.header
        if h.prev_offset == NO_PREV:
            return _ROOT
        t = self.by_offset.get(h.prev_offset)
        if t is not None and hmac.compare_digest(t.header.tag, h.prev_tag) and t.header.generation < h.generation:
            return t
        if self.covered_by_newer(h.prev_offset, h.generation):
            return _OVERWRITTEN
        return _MISSING

    def covered_by_newer(self, pos: int, generation: int) -> bool:
        """A verified record newer than ``generation`` spans ``pos``: the ring reused that place."""
        i = bisect.bisect_right(self.offsets, pos) - 1
        while i >= 0 and self.offsets[i] > pos - MAX_RECORD:
            d = self.by_offset[self.offsets[i]].header
            if d.end > pos and d.generation > generation:
                return True
            i -= 1
        return False


def _walk(sb: Superblock, out: ShardRecovery) -> None:
    """Find the chain (newest first) and mark its records; the rest stay STALE."""
    recs = _Records(out.records)
    W = sb.checkpoint_generation
    dangling: set[int] = set()  # records on paths that hang off a write torn above the checkpoint
    for top in sorted(out.records, key=lambda r: r.header.generation, reverse=True):
        g = top.header.generation
        if g <= sb.floor:
            out.chain_end = ChainEnd.FLOOR
            return
        if W and g <= W and not (top.offset == sb.checkpoint_offset
                                 and hmac.compare_digest(top.header.tag, sb.checkpoint_tag)):
            _head_gone(recs, sb, out)  # every newer record hangs off a torn write
            return
        path, end, brk = _path(top, recs, sb, dangling)
        if end is None:
            dangling.update(r.offset for r in path)
        else:
            out.chain_end, out.break_offset = end, brk
            out.head = path[0].header
            out.chain = path
            return
    if W:  # nothing anchored, and the checkpoint head is not there either
        _head_gone(recs, sb, out)


def _head_gone(recs: _Records, sb: Superblock, out: ShardRecovery) -> None:
    """The checkpoint head is not where the superblock says: the ring reused its place since (a newer
    record spans it), or it is damaged, which ends the chain before it starts."""
    if recs.covered_by_newer(sb.checkpoint_offset, sb.checkpoint_generation):
        out.chain_end = ChainEnd.OVERWRITTEN
    else:
        out.chain_end, out.break_offset = ChainEnd.BREAK, sb.checkpoint_offset


def _path(top: RecordInfo, recs: _Records, sb: Superblock,
          dangling: set[int]) -> tuple[list[RecordInfo], ChainEnd | None, int | None]:
    """Walk back from ``top``: ``(records, how the chain ends, break offset)``, the end None when the path
    hangs off a write torn above the checkpoint (not anchored)."""
    W = sb.checkpoint_generation
    path = [top]
    # The path's offsets, sorted: walked newest first, a lap's records come in falling offsets, each of which
    # a plain list took at its front (moving all the others: quadratic in the records of a shard).
    starts, ends = SortedList([top.offset]), {top.offset: top.header.end}
    cur = top
    while True:
        nxt = recs.link(cur)
        if isinstance(nxt, RecordInfo):
            if nxt.header.generation <= sb.floor:
                return path, ChainEnd.FLOOR, None
            if nxt.offset in dangling:  # joins a path already found hanging off a torn write
                return path, None, None
            i = starts.bisect_left(nxt.header.end)
            if i and ends[starts[i - 1]] > nxt.offset:
                # A newer record of the chain took part of its place: the ring reused it after this one.
                return path, ChainEnd.OVERWRITTEN, None
            starts.add(nxt.offset)
            ends[nxt.offset] = nxt.header.end
            path.append(nxt)
            cur = nxt
            continue
        if nxt == _ROOT:
            return path, ChainEnd.ROOT, None
        if nxt == _OVERWRITTEN:
            return path, ChainEnd.OVERWRITTEN, None
        h = cur.header
        after_head = h.prev_offset == sb.checkpoint_offset and hmac.compare_digest(h.prev_tag, sb.checkpoint_tag)
        if h.generation > W and not (W and after_head):
            return path, None, None  # a write torn above the checkpoint: not anchored
        return path, ChainEnd.BREAK, h.prev_offset


def _adopt(sb: Superblock, out: ShardRecovery) -> None:
    """Newest first along the chain: tombstones, superseded versions, damaged records, live ones."""
    chain = out.chain
    seen: set[bytes] = set()
    dead_keys: set[bytes] = set()
    dead_chunks: set[bytes] = set()
    dead_ns: set[bytes] = set()
    for r in chain:
        h = r.header
        if h.kind is Kind.TOMBSTONE:
            r.fate = Fate.TOMBSTONE
            if r.tombstone is None:  # what it invalidated is unknown: nothing older may be served (they stay STALE)
                out.cut = f"damaged tombstone at offset {r.offset}"
                return
            t = r.tombstone
            (dead_keys if t.scope is Scope.KEYS else dead_chunks).update(t.entries)
            if t.namespace:
                dead_ns.add(t.namespace)
            continue
        pk = h.raw_key
        if pk in seen:
            r.fate = Fate.SUPERSEDED
            continue
        seen.add(pk)
        if pk in dead_keys or pk[:32] in dead_chunks or pk[:16] in dead_ns:
            r.fate = Fate.INVALIDATED
        elif r.status is not Status.VALID:
            r.fate = Fate.DAMAGED
        else:
            r.fate = Fate.LIVE
