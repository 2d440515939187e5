"""The recovery scan (``tiers/ssd/recovery.py``) branch by branch, on shard images built here record by
record the way the tier lays them out: which records are candidates, how the chain is found and where it
ends, what tombstones, floors and damage do to adoption, and how torn and corrupt are told apart."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment, crc32c
from orbitkv_fs.tiers.ssd.record import (BLOCK, NO_PREV, NO_TAG, RECORD_HEADER_SIZE, Kind, Scope, ShardKey,
                                         pack_record_header_into, record_length, tombstone_body, write_record_body)
from orbitkv_fs.tiers.ssd.recovery import ChainEnd, Fate, ShardIdentity, Status, recover_shard
from orbitkv_fs.tiers.ssd.superblock import RING_START, Superblock, copy_offset, pack_superblock

NS = bytes(range(16))
SECRET = bytes(range(1, 33))


def k(i: int, *, ns: bytes = NS, layer: int = 0) -> ObjectKey:
    return ObjectKey(ns, chunk_key(i), layer, Role.KEY)


def seg(i: int, *, n: int = 16, layer: int = 0, version: int = 0) -> bytes:
    payload = np.random.default_rng(1000 * i + version).integers(0, 255, n, dtype=np.uint8).tobytes()
    return build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), n, n, 0, role=Role.KEY, layer=layer), payload)


class Rec:
    def __init__(self, offset: int, gen: int, tag: bytes, length: int) -> None:
        self.offset, self.gen, self.tag, self.length = offset, gen, tag, length

    @property
    def end(self) -> int:
        return self.offset + self.length


class Log:
    """A shard image written as the tier writes one: records appended at the ring head, each linking to
    the previous one, and a superblock checkpoint."""

    def __init__(self, capacity: int = 64 * BLOCK, *, secret: bytes = SECRET) -> None:
        self.image = bytearray(capacity)
        self.capacity = capacity
        self.secret = secret
        self.key = ShardKey(secret)
        self.head = RING_START
        self.prev = (NO_PREV, NO_TAG)
        self.gen = 0
        self.sequence = 0

    def _put(self, kind: Kind, key_field: bytes, body: bytes, scope: Scope, at: int | None, gen: int | None,
             prev: tuple[int, bytes] | None) -> Rec:
        length = record_length(len(body))
        pos = self.head if at is None else at
        if pos + length > self.capacity:
            pos = RING_START
        gen = self.gen + 1 if gen is None else gen
        buf = memoryview(bytearray(length))
        write_record_body(buf, body)
        tag = pack_record_header_into(buf, self.key, kind, key_field, gen, len(body), pos, *(prev or self.prev), scope)
        self.image[pos:pos + length] = buf
        self.head, self.prev, self.gen = pos + length, (pos, tag), max(self.gen, gen)
        return Rec(pos, gen, tag, length)

    def record(self, key: ObjectKey, body: bytes, *, at: int | None = None, gen: int | None = None,
               prev: tuple[int, bytes] | None = None) -> Rec:
        return self._put(Kind.SEGMENT, key.pack(), body, Scope.NONE, at, gen, prev)

    def tombstone(self, scope: Scope, entries: list[bytes] = (), *, namespace: bytes = b"") -> Rec:
        key_field = namespace + bytes(36 - len(namespace))
        return self._put(Kind.TOMBSTONE, key_field, tombstone_body(scope, list(entries)), scope, None, None, None)

    def checkpoint(self, head: Rec | None = None, *, floor: int = 0, index: int = 0, count: int = 1,
                   generations: int | None = None) -> None:
        self.sequence += 1
        sb = Superblock(index, count, self.capacity, self.sequence, self.secret, head.gen if head else 0,
                        head.offset if head else NO_PREV, head.tag if head else NO_TAG, floor,
                        max(self.gen, floor) if generations is None else generations)
        at = copy_offset(self.sequence)
        self.image[at:at + BLOCK] = pack_superblock(sb)

    def flip(self, pos: int) -> None:
        self.image[pos] ^= 0x5A

    def zero(self, rec: Rec) -> None:
        self.image[rec.offset:rec.end] = bytes(rec.length)

    def recover(self, **kw):
        return recover_shard(bytes(self.image), **kw)


def fates(rec) -> dict[int, Fate]:
    return {r.offset: r.fate for r in rec.records}


def live_offsets(rec) -> set[int]:
    return {r.offset for r in rec.live}


def test_a_clean_log_is_recovered_to_its_first_record():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(5)]
    log.checkpoint(rs[-1])
    rec = log.recover(expect=ShardIdentity(0, 1, log.capacity))
    assert rec.problem == "" and rec.chain_end is ChainEnd.ROOT and rec.break_offset is None
    assert [r.offset for r in rec.chain] == [r.offset for r in reversed(rs)]
    assert live_offsets(rec) == {r.offset for r in rs}
    assert rec.head.offset == rs[-1].offset and rec.head.tag == rs[-1].tag
    assert rec.next_generation == 6 and rec.unverified_blocks == 0
    assert all(r.status is Status.VALID for r in rec.records)
    assert rec.scanned_bytes == log.capacity - RING_START


def test_an_empty_shard_and_one_without_a_superblock():
    log = Log()
    log.checkpoint()
    rec = log.recover()
    assert (rec.chain_end, rec.records, rec.head, rec.next_generation) == (ChainEnd.EMPTY, [], None, 1)
    rec = recover_shard(bytes(64 * BLOCK))
    assert rec.problem == "no valid superblock" and rec.records == [] and rec.superblock is None
    assert (rec.next_generation, rec.scanned_bytes, rec.unverified_blocks, rec.cut) == (1, 0, 0, "")
    assert (rec.chain_end, rec.head, rec.break_offset, rec.chain) == (ChainEnd.EMPTY, None, None, [])
    assert recover_shard(b"").problem == "no valid superblock"


def test_a_shard_of_another_layout_is_not_recovered_a_resized_one_is():
    log = Log()
    log.record(k(1), seg(1))
    log.checkpoint(index=1, count=2)
    for expect in (ShardIdentity(0, 2, log.capacity), ShardIdentity(1, 3, log.capacity)):
        rec = log.recover(expect=expect)
        assert "shard 1 of 2" in rec.problem and rec.records == []
    assert len(log.recover(expect=ShardIdentity(1, 2, 2 * log.capacity)).live) == 1
    # Smaller: the records beyond the new end are not scanned.
    log2 = Log()
    a = log2.record(k(1), seg(1))
    b = log2.record(k(2), seg(2), at=40 * BLOCK)
    log2.checkpoint(b)
    rec = log2.recover(expect=ShardIdentity(0, 1, 20 * BLOCK))
    assert [r.offset for r in rec.records] == [a.offset] and rec.chain_end is ChainEnd.BREAK


def test_superseded_versions_and_the_newest_generation():
    log = Log()
    a = log.record(k(1), seg(1))
    b = log.record(k(2), seg(2))
    c = log.record(k(1), seg(1, version=1))
    log.checkpoint(c)
    rec = log.recover()
    assert fates(rec) == {a.offset: Fate.SUPERSEDED, b.offset: Fate.LIVE, c.offset: Fate.LIVE}


@pytest.mark.parametrize("scope", [Scope.KEYS, Scope.CHUNKS, Scope.NAMESPACE])
def test_a_tombstone_invalidates_older_records_of_its_scope_only(scope):
    log = Log()
    other_ns = bytes(16)
    old = log.record(k(1), seg(1))
    other_chunk = log.record(k(2), seg(2))
    other_key = log.record(k(1, layer=1), seg(1, layer=1))
    elsewhere = log.record(k(1, ns=other_ns), seg(1))
    entries = {Scope.KEYS: [k(1).pack()], Scope.CHUNKS: [NS + chunk_key(1)], Scope.NAMESPACE: []}[scope]
    t = log.tombstone(scope, entries, namespace=NS if scope is Scope.NAMESPACE else b"")
    newer = log.record(k(5), seg(5))
    again = log.record(k(1, layer=2), seg(1, layer=2))  # written after the tombstone: not covered
    log.checkpoint(again)
    rec = log.recover()
    f = fates(rec)
    assert f[old.offset] is Fate.INVALIDATED and f[t.offset] is Fate.TOMBSTONE and f[newer.offset] is Fate.LIVE
    assert f[again.offset] is Fate.LIVE
    assert f[elsewhere.offset] is Fate.LIVE
    assert f[other_key.offset] is (Fate.LIVE if scope is Scope.KEYS else Fate.INVALIDATED)
    assert f[other_chunk.offset] is (Fate.INVALIDATED if scope is Scope.NAMESPACE else Fate.LIVE)


def test_a_damaged_tombstone_ends_adoption():
    log = Log()
    old = log.record(k(1), seg(1))
    t = log.tombstone(Scope.KEYS, [k(9).pack()])
    new = log.record(k(2), seg(2))
    log.checkpoint(new)
    log.flip(t.offset + RECORD_HEADER_SIZE + 64 + 3)  # an entry: its CRC32C no longer matches (the tag still does)
    rec = log.recover()
    f = fates(rec)
    assert (f[new.offset], f[t.offset], f[old.offset]) == (Fate.LIVE, Fate.TOMBSTONE, Fate.STALE)
    assert "tombstone" in rec.cut and rec.chain_end is ChainEnd.ROOT
    assert next(r for r in rec.records if r.offset == t.offset).status is Status.CORRUPT


def test_a_damaged_newest_record_shadows_older_versions_of_its_key():
    log = Log()
    old = log.record(k(1), seg(1))
    new = log.record(k(1), seg(1, version=1))
    log.checkpoint(new)
    log.flip(new.offset + RECORD_HEADER_SIZE + 64 + 1)
    rec = log.recover()
    assert fates(rec) == {old.offset: Fate.SUPERSEDED, new.offset: Fate.DAMAGED} and not rec.live


@pytest.mark.parametrize("damage", ["header", "tag", "zeroed", "replaced by an older record's bytes"])
def test_a_durable_record_that_is_gone_ends_the_chain(damage):
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(5)]
    log.checkpoint(rs[-1])
    victim = rs[2]
    if damage == "header":
        log.flip(victim.offset + 45)
    elif damage == "tag":
        log.flip(victim.offset + 120)
    elif damage == "zeroed":
        log.zero(victim)
    else:
        log.image[victim.offset:victim.end] = log.image[rs[0].offset:rs[0].end]
    rec = log.recover()
    assert rec.chain_end is ChainEnd.BREAK and rec.break_offset == victim.offset
    assert live_offsets(rec) == {rs[3].offset, rs[4].offset}
    assert fates(rec)[rs[0].offset] is Fate.STALE and fates(rec)[rs[1].offset] is Fate.STALE


def test_writes_torn_above_the_checkpoint_drop_only_what_hangs_off_them():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(6)]
    log.checkpoint(rs[2])  # rs[3:] were in flight at the crash
    log.zero(rs[3])  # never reached the disk
    rec = log.recover()
    assert rec.chain_end is ChainEnd.ROOT and rec.head.offset == rs[2].offset
    assert live_offsets(rec) == {r.offset for r in rs[:3]}
    assert fates(rec)[rs[4].offset] is Fate.STALE and fates(rec)[rs[5].offset] is Fate.STALE
    assert rec.next_generation == 7  # above every generation found, anchored or not


def test_the_first_record_after_the_checkpoint_missing_its_predecessor_is_a_break():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(4)]
    log.checkpoint(rs[1])
    log.zero(rs[1])  # the checkpoint head: durable, gone
    rec = log.recover()
    assert rec.chain_end is ChainEnd.BREAK and rec.break_offset == rs[1].offset
    assert live_offsets(rec) == {rs[2].offset, rs[3].offset}


def test_a_missing_checkpoint_head_with_nothing_anchored_above_it():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(4)]
    log.checkpoint(rs[2])
    log.zero(rs[3])
    log.zero(rs[2])
    rec = log.recover()
    assert rec.chain_end is ChainEnd.BREAK and rec.break_offset == rs[2].offset and not rec.live
    log.zero(rs[1])
    log.zero(rs[0])
    rec = log.recover()  # nothing left at all
    assert rec.chain_end is ChainEnd.BREAK and rec.records == []


def test_the_ring_wrapping_ends_the_chain_where_records_were_overwritten():
    log = Log(capacity=RING_START + 12 * BLOCK)
    rs = [log.record(k(i), seg(i, n=4096)) for i in range(9)]  # 2-block records: 6 fit, the ring wraps
    log.checkpoint(rs[-1])
    rec = log.recover()
    assert rec.chain_end is ChainEnd.OVERWRITTEN
    assert live_offsets(rec) == {r.offset for r in rs[3:]}
    # A torn write above the checkpoint, and the ring reused places of records before it since: the
    # records between are still anchored (where the ring took their predecessor's place).
    log2 = Log(capacity=RING_START + 12 * BLOCK)
    rs = [log2.record(k(i), seg(i, n=4096)) for i in range(6)]
    log2.checkpoint(rs[0])
    extra = [log2.record(k(10 + i), seg(10 + i, n=4096)) for i in range(2)]  # wrap onto rs[0], rs[1]
    log2.zero(rs[5])  # the write the newer ones link to was torn
    rec = log2.recover()
    assert extra[0].offset == rs[0].offset and rec.chain_end is ChainEnd.OVERWRITTEN
    assert live_offsets(rec) == {r.offset for r in rs[2:5]}


def test_the_checkpoint_head_overwritten_by_records_that_hang_off_a_torn_write():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(4)]
    log.checkpoint(rs[3])
    log.record(k(9), seg(9), at=rs[3].offset, prev=(40 * BLOCK, bytes(16)))  # its predecessor never landed
    rec = log.recover()
    assert rec.chain_end is ChainEnd.OVERWRITTEN and rec.chain == [] and not rec.live
    log.zero(rs[0])
    log.zero(rs[1])
    log.zero(rs[2])
    rec = log.recover()  # no older record either
    assert rec.chain_end is ChainEnd.OVERWRITTEN and rec.chain == []


def test_an_older_record_overlapping_a_newer_one_on_the_chain_ends_it():
    log = Log()
    w = log.record(k(0), seg(0), at=40 * BLOCK)
    y = log.record(k(1), seg(1, n=9000), at=10 * BLOCK)  # 3 blocks
    x = log.record(k(2), seg(2), at=3 * BLOCK)
    z = log.record(k(3), seg(3), at=11 * BLOCK)  # took part of y's place after y was written
    log.checkpoint(z)
    rec = log.recover()
    assert rec.chain_end is ChainEnd.OVERWRITTEN and [r.offset for r in rec.chain] == [z.offset, x.offset]
    assert fates(rec)[y.offset] is Fate.STALE and fates(rec)[w.offset] is Fate.STALE


def test_an_older_record_overlapping_a_newer_one_further_up_the_chain_ends_it():
    """The same, with the record that took the older one's place not the newest: every record walked is
    checked against all the newer ones on the path, not only the first."""
    log = Log()
    w = log.record(k(0), seg(0), at=40 * BLOCK)
    y = log.record(k(1), seg(1, n=9000), at=10 * BLOCK)  # 3 blocks
    x = log.record(k(2), seg(2), at=3 * BLOCK)
    z = log.record(k(3), seg(3), at=11 * BLOCK)  # took part of y's place after y was written
    v = log.record(k(4), seg(4), at=20 * BLOCK)
    u = log.record(k(5), seg(5), at=30 * BLOCK)
    log.checkpoint(u)
    rec = log.recover()
    assert rec.chain_end is ChainEnd.OVERWRITTEN
    assert [r.offset for r in rec.chain] == [u.offset, v.offset, z.offset, x.offset]
    assert fates(rec)[y.offset] is Fate.STALE and fates(rec)[w.offset] is Fate.STALE


def test_a_place_taken_by_a_longer_newer_record_behind_another_header():
    """A link names a record at 12 blocks; what is there is an older record (another tag), inside a newer
    record that starts at 11 blocks: the place was reused, the chain ends there (not a torn write)."""
    log = Log()
    n = log.record(k(1), seg(1, n=4 * BLOCK), at=11 * BLOCK, gen=8, prev=(40 * BLOCK, bytes(16)))  # hangs off a torn write
    s = log.record(k(2), seg(2), at=12 * BLOCK, gen=3, prev=(NO_PREV, NO_TAG))
    last = log.record(k(3), seg(3), at=30 * BLOCK, gen=5, prev=(12 * BLOCK, bytes(range(16))))
    log.checkpoint()
    rec = log.recover()
    assert rec.chain_end is ChainEnd.OVERWRITTEN and live_offsets(rec) == {last.offset}
    assert fates(rec)[n.offset] is Fate.STALE and fates(rec)[s.offset] is Fate.STALE


def test_an_older_record_replayed_at_the_checkpoint_head_s_place():
    log = Log()
    old = log.record(k(1), seg(1))
    image = bytes(log.image[old.offset:old.end])
    head = log.record(k(2), seg(2), at=old.offset)  # the ring took its place
    log.checkpoint(head)
    log.image[old.offset:old.end] = image  # the disk returns the place's older content
    rec = log.recover()
    assert rec.chain_end is ChainEnd.BREAK and rec.break_offset == head.offset and not rec.live


def test_a_link_to_a_newer_record_is_not_followed():
    log = Log()
    a = log.record(k(1), seg(1), at=10 * BLOCK, gen=8, prev=(30 * BLOCK, bytes(16)))  # hangs off a torn write
    b = log.record(k(2), seg(2), at=20 * BLOCK, gen=3, prev=(a.offset, a.tag))  # names a as its predecessor
    log.checkpoint()
    rec = log.recover()
    # a is not anchored; b's predecessor cannot be a newer record: its place was reused.
    assert rec.chain_end is ChainEnd.OVERWRITTEN and live_offsets(rec) == {b.offset}


def test_the_floor():
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(5)]
    log.checkpoint(rs[-1], floor=2)
    rec = log.recover()
    assert rec.chain_end is ChainEnd.FLOOR and live_offsets(rec) == {r.offset for r in rs[2:]}
    log.checkpoint(rs[-1], floor=5)
    rec = log.recover()
    assert rec.chain_end is ChainEnd.FLOOR and rec.chain == [] and rec.next_generation == 6


@pytest.mark.parametrize("gen_offset,status", [(0, Status.CORRUPT), (1, Status.TORN)])
def test_torn_or_corrupt_is_decided_by_the_checkpoint(gen_offset, status):
    log = Log()
    a = log.record(k(1), seg(1))
    b = log.record(k(2), seg(2))
    log.checkpoint(a if gen_offset else b)
    log.flip(b.offset + RECORD_HEADER_SIZE + 70)
    rec = log.recover()
    r = next(r for r in rec.records if r.offset == b.offset)
    assert (r.status, r.fate) == (status, Fate.DAMAGED) and r.error.startswith("PayloadChecksumMismatch")


def test_blocks_that_are_not_records_of_this_log():
    log = Log()
    a = log.record(k(1), seg(1))
    # The image of a valid record under another secret, one copied to another offset, one of the format
    # before version 2, one running past the end of the ring, plain magic: none is a candidate.
    foreign = Log(secret=bytes(32))
    f = foreign.record(k(2), seg(2), at=10 * BLOCK)
    log.image[f.offset:f.end] = foreign.image[f.offset:f.end]
    log.image[20 * BLOCK:20 * BLOCK + a.length] = log.image[a.offset:a.end]
    head = struct.pack("<4sHH36sQII64x", b"OKVR", 1, 128, k(3).pack(), 1 << 40, len(seg(3)), BLOCK)
    log.image[30 * BLOCK:30 * BLOCK + 128 + len(seg(3))] = head + struct.pack("<I", crc32c(head)) + seg(3)
    body = seg(4, n=3 * BLOCK)
    buf = memoryview(bytearray(record_length(len(body))))
    write_record_body(buf, body)
    pack_record_header_into(buf, log.key, Kind.SEGMENT, k(4).pack(), 2, len(body), log.capacity - BLOCK, a.offset, a.tag)
    log.image[log.capacity - BLOCK:] = buf[:BLOCK]
    log.image[40 * BLOCK:40 * BLOCK + 4] = b"OKVR"
    log.image[50 * BLOCK - 100:50 * BLOCK - 96] = b"OKVR"  # not on a block boundary: not even looked at
    log.image[52 * BLOCK - 1:52 * BLOCK + 3] = b"OKVR"  # one byte before one
    log.checkpoint(a)
    rec = log.recover()
    assert [r.offset for r in rec.records] == [a.offset] and rec.unverified_blocks == 5
    assert live_offsets(rec) == {a.offset} and rec.next_generation == 2


def test_a_body_the_image_cuts_short():
    log = Log()
    a = log.record(k(1), seg(1))
    b = log.record(k(2), seg(2, n=6000))
    log.checkpoint(b)
    rec = recover_shard(bytes(log.image[:b.offset + BLOCK + 1000]))
    r = next(r for r in rec.records if r.offset == b.offset)
    assert (r.status, r.fate) == (Status.CORRUPT, Fate.DAMAGED) and r.error.startswith("TruncatedSegment")
    assert live_offsets(rec) == {a.offset}
    rec = recover_shard(bytes(log.image[:b.offset + 1000]))  # a partial last block is not scanned
    assert [r.offset for r in rec.records] == [a.offset] and rec.unverified_blocks == 0
    assert rec.chain_end is ChainEnd.BREAK and rec.break_offset == b.offset


def test_progress_and_views_of_part_of_a_buffer():
    log = Log(capacity=RING_START + 3 * (8 << 20))
    rs = [log.record(k(i), seg(i), at=RING_START + i * (5 << 20)) for i in range(4)]
    log.checkpoint(rs[-1])
    calls = []
    rec = log.recover(on_progress=lambda d, t: calls.append((d, t)))
    assert live_offsets(rec) == {r.offset for r in rs}
    total = log.capacity - RING_START
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) >= 3
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:]))
    # A view of part of a buffer, or at an offset into one: the same records, the same block offsets.
    small = Log()
    s = [small.record(k(i), seg(i)) for i in range(3)]
    small.image[30 * BLOCK:30 * BLOCK + 4] = b"OKVR"
    small.checkpoint(s[-1])
    padded = memoryview(bytes(small.image) + bytes(BLOCK))[:len(small.image)]
    shifted = memoryview(bytes(100) + bytes(small.image))[100:]  # offsets of the view are not the buffer's
    a, b, c = recover_shard(padded), recover_shard(bytes(small.image)), recover_shard(shifted)
    assert [(r.offset, r.fate) for r in a.records] == [(r.offset, r.fate) for r in b.records] == \
        [(r.offset, r.fate) for r in c.records] == [(r.offset, Fate.LIVE) for r in s]
    assert a.unverified_blocks == b.unverified_blocks == c.unverified_blocks == 1


def test_progress_is_reported_every_8_mib():
    log = Log(capacity=RING_START + (24 << 20))
    rs = [log.record(k(i), seg(i), at=RING_START + (i << 20)) for i in range(24)]
    log.checkpoint(rs[-1])
    calls = []
    log.recover(on_progress=lambda d, t: calls.append(d))
    assert calls == [0, 8 << 20, 16 << 20, 24 << 20]


def test_records_at_the_edges_of_the_scans_windows_are_found():
    """The scan finds the blocks that begin with the magic 8 MiB at a time: a record in the first or the last
    block of a window, or in the image's last block, is found like any other, and so is a stray magic there."""
    w = 8 << 20
    log = Log(capacity=RING_START + 2 * w + 2 * BLOCK)
    body = seg(0, n=256)  # one block a record
    at = [RING_START, RING_START + w - BLOCK, RING_START + w, RING_START + 2 * w - BLOCK, RING_START + 2 * w,
          RING_START + 2 * w + BLOCK]
    rs = [log.record(k(i), body, at=a) for i, a in enumerate(at)]
    log.checkpoint(rs[-1])
    rec = log.recover()
    assert [(r.offset, r.fate) for r in rec.records] == [(a, Fate.LIVE) for a in at] and rec.unverified_blocks == 0
    log.zero(rs[3])
    log.image[rs[3].offset:rs[3].offset + 4] = b"OKVR"  # a stray magic, not a record
    assert log.recover().unverified_blocks == 1


def test_an_image_that_ends_inside_the_superblocks():
    log = Log()
    log.checkpoint()
    log.checkpoint()  # sequence 2: block 0
    rec = recover_shard(bytes(log.image[:BLOCK]))
    assert rec.problem == "" and (rec.scanned_bytes, rec.records, rec.chain_end) == (0, [], ChainEnd.EMPTY)


def test_next_generation_takes_the_superblock_into_account():
    log = Log()
    a = log.record(k(1), seg(1))
    log.checkpoint(a, generations=50)
    assert log.recover().next_generation == 51
    log.checkpoint(a, floor=70, generations=70)
    assert log.recover().next_generation == 71


def test_random_damage_never_raises_and_never_adopts_a_record_twice():
    rng = np.random.default_rng(5)
    for trial in range(40):
        log = Log(capacity=RING_START + 24 * BLOCK)
        last = None
        for i in range(int(rng.integers(3, 20))):
            if rng.random() < 0.15:
                last = log.tombstone(Scope.KEYS, [k(int(rng.integers(0, 6))).pack()])
            else:
                j = int(rng.integers(0, 6))
                last = log.record(k(j), seg(j, n=int(rng.integers(8, 9000)), version=i))
        log.checkpoint(last if rng.random() < 0.7 else None)
        for _ in range(int(rng.integers(1, 6))):
            pos = int(rng.integers(0, log.capacity))
            if rng.random() < 0.5:
                log.image[pos] ^= int(rng.integers(1, 256))
            else:
                blk = pos // BLOCK * BLOCK
                log.image[blk:blk + BLOCK] = os.urandom(BLOCK) if rng.random() < 0.5 else bytes(BLOCK)
        rec = log.recover()
        keys = [r.header.key for r in rec.live]
        assert len(keys) == len(set(keys)), trial
        assert all(r.status is Status.VALID for r in rec.live)


def test_a_torn_write_over_the_checkpoint_head_is_not_a_break():
    """The ring came round to the checkpoint head's place: the record written there (after the checkpoint)
    never landed, the head is still whole, and the next record links to the torn one at the head's
    offset. That link names another record than the head: a torn write, not damage."""
    log = Log()
    rs = [log.record(k(i), seg(i)) for i in range(3)]
    log.checkpoint(rs[2])
    head = bytes(log.image[rs[2].offset:rs[2].end])
    x = log.record(k(7), seg(7), at=rs[2].offset)  # links to rs[2], then is lost:
    log.image[rs[2].offset:rs[2].end] = head
    y = log.record(k(8), seg(8), at=20 * BLOCK)  # links to x
    rec = log.recover()
    assert x.offset == rs[2].offset and fates(rec)[y.offset] is Fate.STALE
    assert rec.chain_end is ChainEnd.ROOT and live_offsets(rec) == {r.offset for r in rs}
