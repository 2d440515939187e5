"""The ring of one shard file: where records sit, which space the next record may take, and the shard's
log (the chain of records in allocation order, and how far it is durable).

Primitives:

* :class:`Slot` -- one record's place and bookkeeping (state, leases, the segment's fields).
* :class:`Shard` -- a shard's records by offset and by chunk (:meth:`Shard.chunk_slots`);
  :meth:`Shard.find_room` (the allocator's search);
  :meth:`Shard.link` (the previous record a new one links to) and :meth:`Shard.append` (it becomes the
  chain's tail); :meth:`Shard.settle` (a write ended: the durable front moves over every record whose
  predecessors all ended).

Invariants:

1. The ring is ``[RING_START, capacity)``; slots never overlap. A slot that is WRITING or leased is never
   chosen as a victim: the search skips past it, and fails when a whole lap finds no room.
2. Records are appended to the chain in allocation order, which is generation order within a shard;
   each record links to the one allocated before it (offset and tag).
3. ``front`` is the newest record of the chain whose write, and every earlier record's write, ended
   (completed, failed or cancelled): what a checkpoint may call durable once the file is synced.
"""

from __future__ import annotations

import array
import collections
import enum

import msgspec
from sortedcontainers import SortedList

from ...keys import ObjectKey
from ...segment import Format
from .record import NO_PREV, NO_TAG, ShardKey
from .superblock import RING_START


class State(enum.Enum):
    WRITING = 1
    COMMITTED = 2
    DEAD = 3


class Slot(msgspec.Struct, gc=False, eq=False):
    """One record's place and bookkeeping. Compared and hashed by identity (a shard's sets of a chunk's
    records). Not tracked by Python's cycle collector: it refers to ints, bytes, an :class:`ObjectKey` and
    enum members only, so it can be in no cycle, and a cache holds one per record, millions of them, that a
    full collection would otherwise traverse with the GIL held (0.4 s at 500,000 records:
    docs/results/2026-12-05-gc-pauses)."""

    shard: int
    offset: int
    length: int
    key: ObjectKey | None
    generation: int
    stored: int
    format: Format | None
    original: int
    # The payload CRC32C of the segment: a later submit of the same segment (DRAM evicting its copy) finds it
    # on disk already and is not written again.
    crc: int = 0
    state: State = State.WRITING
    leases: int = 0
    cancel: bool = False  # invalidated while being written: not published when the write completes
    tag: bytes = NO_TAG  # the record's tag, while the chain still needs it (until it is settled)
    done: bool = False  # its write ended (settled on the chain)
    failed: bool = False  # its write ended in an error

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def is_tombstone(self) -> bool:
        return self.key is None


class Shard:
    def __init__(self, index: int, path: str, fid: int, capacity: int, secret: bytes, sb_fd: int) -> None:
        self.index, self.path, self.fid, self.capacity = index, path, fid, capacity
        self.secret = secret  # the shard's secret, and its keyed hashers (records' tags)
        self.key = ShardKey(secret)
        self.sb_fd = sb_fd  # the file, opened for superblock writes, syncs and the lock
        self.sequence = 0  # of the current superblock
        self.head = RING_START
        # Sorted, with insertion and removal in O(log n): a full ring takes and frees records in the middle
        # of the offsets at every write, which a plain list paid for by moving every offset after them
        # (95 us a record with a million records in a shard).
        self.offsets = SortedList()
        self.slots: dict[int, Slot] = {}
        # namespace + chunk (32 bytes) -> the offsets of that chunk's segment records in this ring: what an
        # invalidation of some chunks or keys visits, instead of every record of the shard. Arrays of ints, not
        # sets of slots: a full collection of Python's cycle collector follows every reference of every set
        # (half a million slots at 500,000 records), and an array of ints has none to follow.
        self.by_chunk: dict[bytes, array.array] = {}
        # The log: its tail (what the next record links to), records whose write has not ended in
        # allocation order, and the durable front behind them.
        self.last_offset, self.last_tag = NO_PREV, NO_TAG
        self.order: collections.deque[Slot] = collections.deque()
        self.front: tuple[int, int, bytes] = (0, NO_PREV, NO_TAG)  # generation, offset, tag
        self.checkpointed = 0  # the generation of the last checkpoint written
        self.floor = 0

    def insert(self, slot: Slot) -> None:
        self.offsets.add(slot.offset)
        self.slots[slot.offset] = slot
        if slot.key is not None:
            prefix = slot.key.namespace + slot.key.chunk
            group = self.by_chunk.get(prefix)
            if group is None:
                self.by_chunk[prefix] = array.array("q", (slot.offset,))
            else:
                group.append(slot.offset)

    def remove(self, slot: Slot) -> None:
        self.offsets.remove(slot.offset)
        del self.slots[slot.offset]
        if slot.key is not None:
            prefix = slot.key.namespace + slot.key.chunk
            group = self.by_chunk[prefix]
            group.remove(slot.offset)
            if not group:
                del self.by_chunk[prefix]

    def chunk_records(self, prefix: bytes) -> list[Slot]:
        """The segment records of the chunk named by its 32-byte prefix (namespace + chunk)."""
        slots = self.slots
        return [slots[o] for o in self.by_chunk.get(prefix, ())]

    def chunk_slots(self, prefixes: "set[bytes]") -> list[Slot]:
        """The segment records of the chunks named by their 32-byte prefixes (namespace + chunk)."""
        return [s for p in prefixes for s in self.chunk_records(p)]

    def find_room(self, length: int) -> tuple[int, list[Slot], int] | None:
        """``(offset, victims, skips)``: the first place of ``length`` bytes at or after the head, the slots
        it would overwrite, and how many slots the search skipped past (being written, or leased); None
        when a whole lap finds no room. Changes nothing."""
        if length > self.capacity - RING_START:
            return None
        pos, travelled, skips = self.head, 0, 0
        lap = self.capacity - RING_START
        while travelled <= lap:
            if pos + length > self.capacity:
                travelled += self.capacity - pos
                pos = RING_START
                continue
            i = self.offsets.bisect_left(pos)
            if i > 0 and self.slots[self.offsets[i - 1]].end > pos:
                i -= 1
            victims: list[Slot] = []
            blocker = None
            for off in self.offsets.islice(i):
                if off >= pos + length:
                    break
                s = self.slots[off]
                if s.state is State.WRITING or s.leases:
                    blocker = s
                    break
                victims.append(s)
            if blocker is not None:
                skips += 1
                travelled += blocker.end - pos
                pos = blocker.end
                continue
            return pos, victims, skips
        return None

    def link(self) -> tuple[int, bytes]:
        """The ``(offset, tag)`` a record allocated now links to."""
        return self.last_offset, self.last_tag

    def append(self, slot: Slot, tag: bytes) -> None:
        """``slot`` (its header made, with ``tag``) is the chain's new tail."""
        slot.tag = tag
        self.last_offset, self.last_tag = slot.offset, tag
        self.order.append(slot)

    def settle(self, slot: Slot) -> None:
        """``slot``'s write ended: move the durable front over every record whose predecessors all ended."""
        slot.done = True
        order = self.order
        while order and order[0].done:
            s = order.popleft()
            self.front = (s.generation, s.offset, s.tag)
            s.tag = NO_TAG
