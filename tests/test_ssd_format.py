"""The SSD tier's on-disk headers, pinned byte for byte (docs/format.md): the record header of a segment and
of each tombstone scope with their bodies' heads, the superblock; every parse failure a typed
``SegmentError``; the keyed tag computed as documented, independently of the code under test."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbitkv_fs.errors import (BadMagic, HeaderChecksumMismatch, LengthMismatch, PayloadChecksumMismatch, SegmentError,
                               TruncatedSegment, UnknownFormat, UnsupportedVersion)
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment, crc32c
from orbitkv_fs.tiers.ssd.record import (BLOCK, GEN_MAX, NO_PREV, NO_TAG, RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, Kind,
                                         RecordTagMismatch, Scope, ShardKey, check_segment_body, lay_record_body,
                                         pack_record_header_into, parse_record_header, parse_tombstone, record_header,
                                         record_length, tombstone_body, verify_record, verify_record_head,
                                         verify_record_tag, write_record_body)
from orbitkv_fs.tiers.ssd.superblock import (RING_START, SUPERBLOCK_SIZE, Superblock, copy_offset, new_secret,
                                             pack_superblock, parse_superblock, read_superblocks)

SECRET = bytes(range(32))
KEY = ShardKey(SECRET)
OKEY = ObjectKey(bytes(range(16)), bytes(range(16, 32)), 3, Role.VALUE)
SEG = build_segment(SegmentHeader(Format.RAW, np.dtype(np.float16), 8, 8, 0, role=Role.VALUE, layer=3), bytes(range(8)))
GEN = 0x0102030405060708
PREV = (5 * BLOCK, bytes(range(100, 116)))

GOLDEN_SEGMENT = bytes.fromhex(
    "4f4b565301000000000200000300000308000000080000003bbc2c8a00000000010000000000000000000000000000000000000000000000"
    "00000000ebf4b3f90001020304050607")
GOLDEN_RECORD_HEADER = bytes.fromhex(
    "4f4b565202000100000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f03000200080706050403020148000000"
    "00100000002000000000000000500000000000006465666768696a6b6c6d6e6f7071727300000000000000000000000000000000bc36ed48"
    "56abe495ac3d88a1b333328adfdce56f")
GOLDEN_TOMBSTONE_KEYS = bytes.fromhex(
    "4f4b565202000201000000000000000000000000000000000000000000000000000000000000000000000000090000000000000064000000"
    "0010000000300000000000000020000000000000bc36ed4856abe495ac3d88a1b333328a00000000000000000000000000000000ee910d60"
    "3016ef4499551eb63b1034597f35ebe74f4b56540100000024000000a47bc3c3000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "03000200")
GOLDEN_TOMBSTONE_CHUNKS = bytes.fromhex(
    "4f4b5652020002020000000000000000000000000000000000000000000000000000000000000000000000000a0000000000000060000000"
    "0010000000400000000000000030000000000000ee910d603016ef4499551eb63b103459000000000000000000000000000000009e1364c6"
    "23814f39d309be8cb531d74ce4c99e8b4f4b565401000000200000004e79dd46000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
GOLDEN_TOMBSTONE_NAMESPACE = bytes.fromhex(
    "4f4b565202000203000102030405060708090a0b0c0d0e0f00000000000000000000000000000000000000000b0000000000000040000000"
    "00100000005000000000000000400000000000009e1364c623814f39d309be8cb531d74c0000000000000000000000000000000077ab3e68"
    "7c560a7aa688784df078cec7a11e5f5c4f4b5654000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000")
GOLDEN_SUPERBLOCK = bytes.fromhex(
    "4f4b564201000000010000000200000000001000000000000700000000000000000102030405060708090a0b0c0d0e0f1011121314151617"
    "18191a1b1c1d1e1f05000000000000000020000000000000abababababababababababababababab02000000000000000900000000000000"
    "cfd6740ad1690cebb1ebdce10aeffcfd")
SUPERBLOCK = Superblock(1, 2, 1 << 20, 7, SECRET, 5, 8192, b"\xab" * 16, 2, 9)


def _tag(header: bytes, body: bytes) -> bytes:
    """The record tag as docs/format.md defines it, computed here without the code under test."""
    return hashlib.blake2b(header[:108] + body[:64], key=SECRET, digest_size=16, person=b"orbitkv-record").digest()


def _tombstone(scope: Scope, entries, key_field: bytes, gen: int, offset: int, prev) -> bytes:
    body = tombstone_body(scope, entries)
    buf = bytearray(record_length(len(body)))
    buf[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + len(body)] = body
    pack_record_header_into(buf, KEY, Kind.TOMBSTONE, key_field, gen, len(body), offset, *prev, scope)
    return bytes(buf[:RECORD_HEADER_SIZE + len(body)])


def test_golden_segment_record_header():
    assert SEG == GOLDEN_SEGMENT
    header, tag = record_header(KEY, Kind.SEGMENT, OKEY.pack(), GEN, SEG[:64], len(SEG), 2 * BLOCK, *PREV)
    assert header == GOLDEN_RECORD_HEADER and len(header) == RECORD_HEADER_SIZE == 128
    assert tag == header[108:124] == _tag(header, SEG)
    assert header[124:] == crc32c(header[:124]).to_bytes(4, "little")
    # Field offsets as the table in docs/format.md gives them.
    assert header[:4] == b"OKVR" and struct.unpack_from("<HBB", header, 4) == (2, 1, 0)
    assert header[8:44] == OKEY.pack()
    assert struct.unpack_from("<QIIQQ", header, 44) == (GEN, len(SEG), BLOCK, 2 * BLOCK, 5 * BLOCK)
    assert header[76:92] == PREV[1] and header[92:108] == bytes(16)
    rh = parse_record_header(header)
    assert (rh.kind, rh.key, rh.generation, rh.body_length, rh.record_length, rh.offset, rh.prev_offset, rh.prev_tag,
            rh.tag, rh.scope) == (Kind.SEGMENT, OKEY, GEN, len(SEG), BLOCK, 2 * BLOCK, *PREV, tag, Scope.NONE)


def test_golden_tombstones():
    _, t1 = record_header(KEY, Kind.SEGMENT, OKEY.pack(), GEN, SEG[:64], len(SEG), 2 * BLOCK, *PREV)
    keys = _tombstone(Scope.KEYS, [OKEY.pack()], bytes(36), 9, 3 * BLOCK, (2 * BLOCK, t1))
    chunks = _tombstone(Scope.CHUNKS, [OKEY.namespace + OKEY.chunk], bytes(36), 10, 4 * BLOCK, (3 * BLOCK, keys[108:124]))
    ns = _tombstone(Scope.NAMESPACE, [], OKEY.namespace + bytes(20), 11, 5 * BLOCK, (4 * BLOCK, chunks[108:124]))
    assert (keys, chunks, ns) == (GOLDEN_TOMBSTONE_KEYS, GOLDEN_TOMBSTONE_CHUNKS, GOLDEN_TOMBSTONE_NAMESPACE)
    for rec, scope, entries in ((keys, Scope.KEYS, {OKEY.pack()}), (chunks, Scope.CHUNKS, {OKEY.pack()[:32]}),
                                (ns, Scope.NAMESPACE, set())):
        assert rec[108:124] == _tag(rec[:128], rec[128:])
        assert rec[124:128] == crc32c(rec[:124]).to_bytes(4, "little")
        body = rec[128:]
        # Tombstone head: "OKVT", entries, entry size, CRC32C of the entries, zeros.
        assert body[:4] == b"OKVT" and body[16:64] == bytes(48)
        rh = parse_record_header(rec)
        verify_record_tag(rec, KEY)
        t = parse_tombstone(rh, body)
        assert (rh.kind, rh.scope, t.scope, set(t.entries)) == (Kind.TOMBSTONE, scope, scope, entries)
        assert t.covers(OKEY.pack())
        assert not t.covers(ObjectKey(bytes(16), OKEY.chunk, 3, Role.VALUE).pack())
    assert parse_tombstone(parse_record_header(ns), ns[128:]).namespace == OKEY.namespace
    assert not parse_tombstone(parse_record_header(chunks), chunks[128:]).covers(
        ObjectKey(OKEY.namespace, bytes(16), 3, Role.VALUE).pack())


def test_golden_superblock():
    block = pack_superblock(SUPERBLOCK)
    assert len(block) == BLOCK and block[SUPERBLOCK_SIZE:] == bytes(BLOCK - SUPERBLOCK_SIZE)
    assert block[:SUPERBLOCK_SIZE] == GOLDEN_SUPERBLOCK
    assert block[112:128] == hashlib.blake2b(block[:112], key=SECRET, digest_size=16, person=b"orbitkv-superbk").digest()
    assert struct.unpack_from("<4sHHIIQQ", block) == (b"OKVB", 1, 0, 1, 2, 1 << 20, 7)
    assert block[32:64] == SECRET and struct.unpack_from("<QQ", block, 64) == (5, 8192)
    assert block[80:96] == b"\xab" * 16 and struct.unpack_from("<QQ", block, 96) == (2, 9)
    assert parse_superblock(block) == SUPERBLOCK
    assert (RING_START, copy_offset(7), copy_offset(8)) == (2 * BLOCK, BLOCK, 0)
    assert len(new_secret()) == 32 and new_secret() != new_secret()


def _recrc(b: bytearray) -> bytes:
    """A header edited on purpose, its CRC made right again (to reach the checks after the CRC)."""
    b[124:128] = crc32c(bytes(b[:124])).to_bytes(4, "little")
    return bytes(b)


def test_record_header_errors_are_typed():
    good = GOLDEN_RECORD_HEADER

    def bad(pos: int, data: bytes, err: type) -> None:
        b = bytearray(good)
        b[pos:pos + len(data)] = data
        with pytest.raises(err):
            parse_record_header(_recrc(b))

    with pytest.raises(TruncatedSegment):
        parse_record_header(good[:127])
    bad(0, b"OKVS", BadMagic)
    bad(4, struct.pack("<H", 1), UnsupportedVersion)  # the format before (no tag): never read
    bad(4, struct.pack("<H", 3), UnsupportedVersion)
    bad(6, b"\x03", UnknownFormat)  # kind
    bad(7, b"\x01", UnknownFormat)  # a segment with a scope
    bad(6, b"\x02", UnknownFormat)  # a tombstone without one
    bad(100, b"\x01", UnknownFormat)  # reserved bytes
    bad(43, b"\x01", UnknownFormat)  # key padding
    bad(42, b"\x07", UnknownFormat)  # role
    bad(52, struct.pack("<I", 63), LengthMismatch)  # body shorter than its head
    bad(52, struct.pack("<I", 64 + (32 << 20) + 1), LengthMismatch)  # longer than the largest segment
    bad(56, struct.pack("<I", 2 * BLOCK), LengthMismatch)  # record length does not match
    bad(44, struct.pack("<Q", 0), LengthMismatch)
    assert GEN_MAX == 1 << 62
    bad(44, struct.pack("<Q", (1 << 62) + 1), LengthMismatch)
    bad(60, struct.pack("<Q", 2 * BLOCK + 1), LengthMismatch)
    bad(68, struct.pack("<Q", 5 * BLOCK + 8), LengthMismatch)
    # A tombstone key field carries only a namespace, and only for that scope.
    ns = bytearray(GOLDEN_TOMBSTONE_NAMESPACE[:128])
    ns[30] = 1
    with pytest.raises(UnknownFormat):
        parse_record_header(_recrc(ns))
    keys = bytearray(GOLDEN_TOMBSTONE_KEYS[:128])
    keys[8] = 1
    with pytest.raises(UnknownFormat):
        parse_record_header(_recrc(keys))
    assert parse_record_header(GOLDEN_TOMBSTONE_KEYS).body_length == 100  # bounds of a tombstone body
    big = bytearray(GOLDEN_TOMBSTONE_KEYS[:128])
    struct.pack_into("<II", big, 52, 64 + (1 << 20) + 36, record_length(64 + (1 << 20) + 36))
    with pytest.raises(LengthMismatch):
        parse_record_header(_recrc(big))
    struct.pack_into("<II", big, 52, 64 + (1 << 20), record_length(64 + (1 << 20)))
    assert parse_record_header(_recrc(big)).body_length == 64 + (1 << 20)
    b = bytearray(good)
    struct.pack_into("<Q", b, 68, NO_PREV)
    assert parse_record_header(_recrc(b)).prev_offset == NO_PREV
    b = bytearray(good)
    struct.pack_into("<Q", b, 44, 1 << 62)
    assert parse_record_header(_recrc(b)).generation == 1 << 62
    b = bytearray(good)
    struct.pack_into("<Q", b, 44, 1)
    assert parse_record_header(_recrc(b)).generation == 1


def test_the_header_crc_covers_every_byte_after_the_version():
    for pos in range(6, 128):
        b = bytearray(GOLDEN_RECORD_HEADER)
        b[pos] ^= 1
        with pytest.raises(HeaderChecksumMismatch):
            parse_record_header(bytes(b))


def test_tag_binds_every_covered_byte():
    image = GOLDEN_RECORD_HEADER + SEG
    verify_record_tag(image, KEY)
    for pos in list(range(0, 124)) + list(range(128, 192)):
        b = bytearray(image)
        b[pos] ^= 1
        with pytest.raises(RecordTagMismatch):
            verify_record_tag(bytes(b), KEY)
    with pytest.raises(RecordTagMismatch):
        verify_record_tag(image, ShardKey(bytes(32)))
    with pytest.raises(TruncatedSegment):
        verify_record_tag(image[:RECORD_HEAD_BYTES - 1], KEY)
    assert issubclass(RecordTagMismatch, HeaderChecksumMismatch)
    with pytest.raises(ValueError):
        ShardKey(bytes(31))


def _record(seg: bytes = SEG, offset: int = 2 * BLOCK) -> bytes:
    buf = memoryview(bytearray(record_length(len(seg))))
    buf[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + len(seg)] = seg
    pack_record_header_into(buf, KEY, Kind.SEGMENT, OKEY.pack(), GEN, len(seg), offset, *PREV)
    return bytes(buf)


CRC = int.from_bytes(SEG[24:28], "little")


def test_demand_read_check():
    rec = _record()
    args = (2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC)
    assert bytes(verify_record(rec, *args)) == SEG
    verify_record_head(rec[:RECORD_HEAD_BYTES], *args)
    other = ObjectKey(bytes(16), OKEY.chunk, 3, Role.VALUE).pack()
    for bad in ((3 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC), (2 * BLOCK, other, GEN, len(SEG), CRC),
                (2 * BLOCK, OKEY.pack(), GEN - 1, len(SEG), CRC), (2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC ^ 1)):
        with pytest.raises(SegmentError):
            verify_record(rec, *bad)
        with pytest.raises(SegmentError):
            verify_record_head(rec[:RECORD_HEAD_BYTES], *bad)
    with pytest.raises(TruncatedSegment):
        verify_record(rec[:RECORD_HEADER_SIZE + len(SEG) - 1], *args)
    with pytest.raises(TruncatedSegment):
        verify_record_head(rec[:RECORD_HEAD_BYTES - 1], *args)
    # The payload against the CRC32C (a byte after the segment header).
    b = bytearray(rec)
    b[RECORD_HEADER_SIZE + 64 + 3] ^= 1
    with pytest.raises(PayloadChecksumMismatch):
        verify_record(bytes(b), *args)
    verify_record_head(bytes(b)[:RECORD_HEAD_BYTES], *args)
    # Any damage to the header (the tag, the link, reserved bytes): its CRC.
    for pos in (80, 100, 110, 126):
        b = bytearray(rec)
        b[pos] ^= 1
        with pytest.raises(HeaderChecksumMismatch):
            verify_record(bytes(b), *args)
        with pytest.raises(HeaderChecksumMismatch):
            verify_record_head(bytes(b)[:RECORD_HEAD_BYTES], *args)
    # A tombstone's header is not a segment record's; nor one of another version.
    with pytest.raises(BadMagic):
        verify_record(GOLDEN_TOMBSTONE_KEYS, 3 * BLOCK, bytes(36), 9, 100, 0)
    for pos, v in ((0, b"X"), (4, b"\x01")):
        b = bytearray(rec)
        b[pos:pos + 1] = v
        with pytest.raises(BadMagic):
            verify_record(bytes(b), *args)
    # Record length that does not match the segment length the index holds.
    with pytest.raises(SegmentError):
        verify_record(rec + bytes(BLOCK), 2 * BLOCK, OKEY.pack(), GEN, len(SEG) + BLOCK, CRC)


def _tagged(seg: bytes, *, okey: ObjectKey = OKEY) -> bytes:
    """A record over ``seg`` whose header is right whatever ``seg`` holds (the checks after the header)."""
    buf = bytearray(RECORD_HEADER_SIZE + len(seg))
    buf[RECORD_HEADER_SIZE:] = seg
    pack_record_header_into(buf, KEY, Kind.SEGMENT, okey.pack(), GEN, len(seg), 2 * BLOCK, *PREV)
    return bytes(buf)


def test_demand_read_segment_header_checks():
    seg = bytearray(SEG)
    seg[0:4] = b"XKVS"
    with pytest.raises(BadMagic):
        verify_record(_tagged(bytes(seg)), 2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC)
    seg = bytearray(SEG)
    seg[61] ^= 1  # its own CRC
    with pytest.raises(HeaderChecksumMismatch):
        verify_record(_tagged(bytes(seg)), 2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC)
    with pytest.raises(LengthMismatch):  # the segment header's length disagrees with the record's
        verify_record(_tagged(SEG + bytes(8)), 2 * BLOCK, OKEY.pack(), GEN, len(SEG) + 8, CRC)
    # A device read: the segment header must name the record key's layer and role.
    for role, layer in ((Role.KEY, 3), (Role.VALUE, 4)):
        wrong = build_segment(SegmentHeader(Format.RAW, np.dtype(np.float16), 8, 8, 0, role=role, layer=layer), bytes(8))
        with pytest.raises(SegmentError, match="layer/role"):
            verify_record_head(_tagged(wrong)[:RECORD_HEAD_BYTES], 2 * BLOCK, OKEY.pack(), GEN, len(wrong),
                               int.from_bytes(wrong[24:28], "little"))


def test_segment_body_check():
    rh = parse_record_header(_record())
    assert check_segment_body(rh, SEG).layer == 3
    with pytest.raises(TruncatedSegment):
        check_segment_body(rh, SEG[:-1])
    for role, layer in ((Role.KEY, 3), (Role.VALUE, 2)):
        wrong = build_segment(SegmentHeader(Format.RAW, np.dtype(np.float16), 8, 8, 0, role=role, layer=layer), bytes(8))
        with pytest.raises(SegmentError, match="layer/role"):
            check_segment_body(rh, wrong)
    b = bytearray(SEG)
    b[-1] ^= 1
    with pytest.raises(PayloadChecksumMismatch):
        check_segment_body(rh, bytes(b))


def test_tombstone_errors_are_typed():
    rh = parse_record_header(GOLDEN_TOMBSTONE_KEYS)
    body = GOLDEN_TOMBSTONE_KEYS[128:]

    def bad(pos: int, data: bytes, err: type) -> None:
        b = bytearray(body)
        b[pos:pos + len(data)] = data
        with pytest.raises(err):
            parse_tombstone(rh, bytes(b))

    with pytest.raises(TruncatedSegment):
        parse_tombstone(rh, body[:-1])
    bad(0, b"OKVS", BadMagic)
    bad(40, b"\x01", BadMagic)
    bad(8, struct.pack("<I", 32), LengthMismatch)  # entry size of another scope
    bad(4, struct.pack("<I", 2), LengthMismatch)  # count does not fill the body
    bad(64, b"\xff", PayloadChecksumMismatch)
    with pytest.raises(LengthMismatch):
        tombstone_body(Scope.KEYS, [bytes(32)])
    with pytest.raises(LengthMismatch):
        tombstone_body(Scope.NAMESPACE, [b""])
    with pytest.raises(LengthMismatch):
        tombstone_body(Scope.KEYS, [bytes(36)] * ((1 << 20) // 36 + 1))
    assert len(tombstone_body(Scope.KEYS, [bytes(36)] * ((1 << 20) // 36))) == 64 + (1 << 20) // 36 * 36


def test_superblock_errors_are_typed_and_the_newest_valid_copy_wins():
    good = pack_superblock(SUPERBLOCK)

    def bad(pos: int, data: bytes, err: type) -> None:
        b = bytearray(good)
        b[pos:pos + len(data)] = data
        with pytest.raises(err):
            parse_superblock(bytes(b))

    with pytest.raises(TruncatedSegment):
        parse_superblock(good[:SUPERBLOCK_SIZE - 1])
    bad(0, b"OKVR", BadMagic)
    bad(4, b"\x02", UnsupportedVersion)
    bad(6, b"\x01", UnknownFormat)
    bad(40, b"\x00", RecordTagMismatch)
    fields = {f: getattr(SUPERBLOCK, f) for f in SUPERBLOCK.__slots__}
    for field in (dict(sequence=0), dict(shard_count=0), dict(shard_index=2), dict(capacity=(1 << 20) + 1),
                  dict(capacity=RING_START), dict(secret=bytes(31)), dict(checkpoint_tag=bytes(15)),
                  dict(checkpoint_generation=GEN_MAX + 1, generations=GEN_MAX + 1), dict(floor=GEN_MAX + 1),
                  dict(generations=GEN_MAX + 1), dict(checkpoint_generation=0),
                  dict(checkpoint_generation=0, checkpoint_offset=NO_PREV), dict(checkpoint_offset=8192 + 1),
                  dict(checkpoint_offset=BLOCK), dict(checkpoint_offset=1 << 20), dict(checkpoint_generation=10)):
        with pytest.raises(LengthMismatch):
            pack_superblock(Superblock(**{**fields, **field}))
    for ok in (dict(checkpoint_generation=0, checkpoint_offset=NO_PREV, checkpoint_tag=NO_TAG),
               dict(checkpoint_offset=RING_START), dict(checkpoint_offset=(1 << 20) - BLOCK),
               dict(checkpoint_generation=9), dict(floor=GEN_MAX, generations=GEN_MAX), dict(shard_index=0)):
        assert parse_superblock(pack_superblock(Superblock(**{**fields, **ok}))) == Superblock(**{**fields, **ok})
    # Two copies: the valid one of the larger sequence wins; a copy in the other's block is refused.
    older = pack_superblock(Superblock(**{**fields, "sequence": 6}))
    image = good + older  # sequence 7 belongs in block 1, 6 in block 0: both misplaced
    sb, errors = read_superblocks(image)
    assert sb is None and all(errors)
    sb, errors = read_superblocks(older + good)
    assert sb == SUPERBLOCK and errors == ["", ""]
    sb, errors = read_superblocks(older + bytes(BLOCK))
    assert sb.sequence == 6 and errors[0] == "" and "BadMagic" in errors[1]
    newer = pack_superblock(Superblock(**{**fields, "sequence": 8}))
    sb, _ = read_superblocks(newer + good)
    assert sb.sequence == 8
    damaged = bytearray(newer)
    damaged[70] ^= 1
    sb, errors = read_superblocks(bytes(damaged) + good)
    assert sb.sequence == 7 and "RecordTagMismatch" in errors[0]


def test_device_layout_guards_its_buffer():
    with pytest.raises(LengthMismatch):
        lay_record_body(np.zeros(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8))
    with pytest.raises(LengthMismatch):
        record_header(KEY, Kind.SEGMENT, OKEY.pack(), GEN, SEG[:63], len(SEG), 2 * BLOCK, *PREV)
    with pytest.raises(LengthMismatch):
        record_header(KEY, Kind.SEGMENT, OKEY.pack(), GEN_MAX + 1, SEG[:64], len(SEG), 2 * BLOCK, *PREV)
    with pytest.raises(LengthMismatch):
        record_header(KEY, Kind.SEGMENT, OKEY.pack(), 0, SEG[:64], len(SEG), 2 * BLOCK, *PREV)


_RECORDS = [GOLDEN_RECORD_HEADER + SEG, GOLDEN_TOMBSTONE_KEYS, GOLDEN_TOMBSTONE_CHUNKS, GOLDEN_TOMBSTONE_NAMESPACE]


@settings(max_examples=400, deadline=None)
@given(base=st.sampled_from(_RECORDS), edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, 400))
def test_parsers_raise_only_typed_errors(base, edits, cut):
    b = bytearray(base)
    for pos, v in edits:
        if pos < len(b):
            b[pos] = v
    data = bytes(b[:cut])
    for fn in (lambda: parse_record_header(data), lambda: verify_record_tag(data, KEY),
               lambda: parse_tombstone(parse_record_header(data), data[128:]),
               lambda: check_segment_body(parse_record_header(data), data[128:]),
               lambda: verify_record(data, 2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC),
               lambda: verify_record_head(data, 2 * BLOCK, OKEY.pack(), GEN, len(SEG), CRC),
               lambda: parse_superblock(data), lambda: read_superblocks(data)):
        try:
            fn()
        except SegmentError:
            pass


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_raise_only_typed_errors(data):
    for fn in (parse_record_header, parse_superblock, lambda d: verify_record_tag(d, KEY)):
        try:
            fn(data)
        except SegmentError:
            pass


def test_the_first_record_of_a_log_links_to_nothing():
    header, _ = record_header(KEY, Kind.SEGMENT, OKEY.pack(), 1, SEG[:64], len(SEG), RING_START, NO_PREV, NO_TAG)
    assert header[68:92] == b"\xff" * 8 + bytes(16)  # all ones, and a zero tag
    assert parse_record_header(header).prev_offset == (1 << 64) - 1


@pytest.mark.parametrize("n", [1000, 300_000, 1 << 20])
def test_record_body_layout(n):
    """The body after the header space and zero padding to the block, also for bodies copied without the
    GIL (256 KiB and more), into a reused buffer."""
    body = bytes(range(256)) * (n // 256) + b"\x07" * (n % 256)
    rec_len = record_length(n)
    buf = memoryview(bytearray(b"\xaa" * (rec_len + BLOCK)))
    assert write_record_body(buf, body) == rec_len
    assert bytes(buf[:RECORD_HEADER_SIZE]) == b"\xaa" * RECORD_HEADER_SIZE  # the header's place is left alone
    assert bytes(buf[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + n]) == body
    assert bytes(buf[RECORD_HEADER_SIZE + n:rec_len]) == bytes(rec_len - RECORD_HEADER_SIZE - n)
    assert bytes(buf[rec_len:]) == b"\xaa" * BLOCK


@pytest.mark.parametrize("n", [1000, 300_000])
def test_lay_record_body_lays_what_write_record_body_writes(n):
    """The array path (numpy here, CuPy on the device) lays the same bytes as the host path, padding zeroed
    over a reused buffer and the header's place left alone."""
    body = np.frombuffer(bytes(range(256)) * (n // 256) + b"\x05" * (n % 256), np.uint8)
    rec_len = record_length(n)
    host = memoryview(bytearray(b"\xaa" * rec_len))
    arr = np.full(rec_len + BLOCK, 0xAA, np.uint8)
    assert lay_record_body(arr, body) == write_record_body(host, body.tobytes()) == rec_len
    assert arr[:rec_len].tobytes() == bytes(host)
    assert arr[rec_len:].tobytes() == b"\xaa" * BLOCK


def test_largest_record_is_the_largest_segment_aligned():
    # 128-byte record header + 64-byte segment header + 32 MiB payload, rounded up to the 4 KiB block.
    from orbitkv_fs.tiers.ssd.record import MAX_RECORD

    assert MAX_RECORD == (32 << 20) + 4096 == record_length(64 + (32 << 20))
