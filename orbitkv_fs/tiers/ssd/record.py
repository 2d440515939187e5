"""The SSD record (format version 2): how one cached segment, or one tombstone, sits in a shard file.

A shard file is a superblock region (:mod:`.superblock`) followed by a ring of records, each starting on a
:data:`BLOCK` (4 KiB) boundary::

    record header (128 bytes) | body (64-byte body head + the rest) | zero padding to BLOCK

Record header (little endian; ``docs/format.md`` is the normative table)::

    0    4s   magic "OKVR"
    4    H    version (2)
    6    B    kind: 1 segment, 2 tombstone
    7    B    tombstone scope: 1 keys, 2 chunks, 3 namespace (0 for a segment)
    8    36s  segment: ObjectKey.pack(); tombstone of a namespace: the namespace, then zeros; else zeros
    44   Q    generation (tier-wide, strictly increasing; 1 .. GEN_MAX)
    52   I    body length (a segment: 64-byte segment header + payload; a tombstone: 64 + entries)
    56   I    record length (header + body + padding, a multiple of BLOCK)
    60   Q    the record's own byte offset in the shard file
    68   Q    offset of the previous record of this shard's log (NO_PREV for the first)
    76   16s  tag of that previous record (zeros for the first)
    92   16x  reserved, zero
    108  16s  tag: keyed BLAKE2b-128 (the shard's secret) of bytes 0..107 and the body's first 64 bytes
    124  I    CRC32C of bytes 0..123

The body's first 64 bytes are the segment header, which carries the payload's CRC32C (a segment), or the
tombstone head, which carries its entries' CRC32C (a tombstone). So the tag binds a record's key,
generation, position, place in the log and payload together, and only the holder of the shard's secret
(the Manager: engines write KV content but cannot read shard files) can make one that verifies. A byte
image of a record inside some payload is therefore never a record, a record copied elsewhere fails its
offset, a body swapped between records fails the tag or the payload CRC. The header CRC is what a demand
read checks: the index already says which record must be where, so only damage is in question there, and
a CRC costs a fifth of a tag.

Tombstone body: ``"OKVT" | u32 entries | u32 entry size | u32 CRC32C of the entries | 48 zero bytes``,
then the entries: packed object keys (36 bytes, scope keys) or namespace + chunk (32 bytes, scope chunks);
none for scope namespace (the namespace is in the header's key field).

Primitives:

* :class:`ShardKey` -- a shard's secret as keyed hashers: :meth:`ShardKey.record_tag`,
  :meth:`ShardKey.superblock_tag` (domain-separated).
* :func:`record_length` -- the aligned footprint of a body of a given size.
* :func:`pack_record_header_into` -- fields into a staging buffer whose body is already laid, tag
  computed there; :func:`record_header` -- the same as 128 bytes, given the body head separately (the
  cuFile direct path: the body is in device memory, the header is made on the host).
* :func:`write_record_body` / :func:`lay_record_body` / :func:`put_record_header` / :func:`lay_record` --
  the layout into a staging buffer or into any 1-D uint8 array, numpy or CuPy (the device path lays the
  same bytes).
* :func:`parse_record_header` -- decoding, the header CRC and structure (no secret needed);
  :func:`verify_record_tag`.
* :func:`check_segment_body` / :func:`parse_tombstone` -- full body checks (recovery, inspection).
* :func:`tombstone_body` -- the body of a tombstone.
* :func:`verify_record` -- the demand-read check: the header CRC, and against the index key, generation,
  length, offset, the segment header's CRC and length, its payload CRC32C against the one the index
  recorded, the payload;
  :func:`verify_record_head` -- the same over the first :data:`RECORD_HEAD_BYTES` only (device reads: the
  payload CRC32C is checked on the GPU).

Invariants: nothing here trusts a length before checking it against its bounds and the buffer; every
failure is a :class:`~orbitkv_fs.errors.SegmentError` subclass, never another exception; a record is
written only with its tag and CRC; recovery takes none whose tag does not verify, a demand read none whose
CRC does not, or that differs from what the index recorded of it.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np

from ...errors import (
    BadMagic,
    HeaderChecksumMismatch,
    LengthMismatch,
    PayloadChecksumMismatch,
    SegmentError,
    TruncatedSegment,
    UnknownFormat,
    UnsupportedVersion,
)
from ...keys import PACKED_SIZE, ObjectKey, key_layer_role
from ...segment import HEADER_SIZE, MAX_STORED_BYTES, SegmentHeader, parse_header, parse_segment
from ...segment import MAGIC as SEGMENT_MAGIC

MAGIC = b"OKVR"
VERSION = 2
BLOCK = 4096
RECORD_HEADER_SIZE = 128
#: Bytes of the body the tag covers: the segment header, or the tombstone head.
BODY_HEAD = 64
#: Record header and body head: what a device read copies to the host to check a record.
RECORD_HEAD_BYTES = RECORD_HEADER_SIZE + BODY_HEAD
#: The largest record a segment can need (header + biggest segment, aligned).
MAX_RECORD = -(-(RECORD_HEADER_SIZE + HEADER_SIZE + MAX_STORED_BYTES) // BLOCK) * BLOCK
#: Generations are 1 .. GEN_MAX. A tier never allocates past it (writes are refused, counted), and
#: recovery does not take a record beyond it for one: a u64 field never wraps.
GEN_MAX = 1 << 62
#: ``prev_offset`` of the first record of a log.
NO_PREV = (1 << 64) - 1
TAG_SIZE = 16
NO_TAG = bytes(TAG_SIZE)
TAG_AT = 108  # the tag covers header bytes 0..TAG_AT-1 (and the body head)
CRC_AT = TAG_AT + TAG_SIZE  # the header CRC covers bytes 0..CRC_AT-1, the tag included

assert BODY_HEAD == HEADER_SIZE


class Kind(enum.IntEnum):
    SEGMENT = 1
    TOMBSTONE = 2


class Scope(enum.IntEnum):
    """What a tombstone invalidates (every record of its shard older than it that matches)."""

    NONE = 0  # a segment record
    KEYS = 1
    CHUNKS = 2
    NAMESPACE = 3


_KINDS = {m.value: m for m in Kind}
_SCOPES = {m.value: m for m in Scope}
#: Tombstone entry size per scope.
ENTRY_SIZE = {Scope.KEYS: PACKED_SIZE, Scope.CHUNKS: 32, Scope.NAMESPACE: 0}
#: The largest tombstone body (entries are split over several tombstones beyond it).
MAX_TOMBSTONE_BODY = 1 << 20

_STRUCT = struct.Struct(f"<4sHBB{PACKED_SIZE}sQIIQQ16s16x16sI")
assert _STRUCT.size == RECORD_HEADER_SIZE
_FIELDS = struct.Struct(f"<4sHBB{PACKED_SIZE}sQIIQQ16s")  # everything before the reserved bytes
assert _FIELDS.size == 92
_GIL_FREE_COPY = 256 << 10
_ZEROS = memoryview(bytes(BLOCK))  # padding never reaches a whole block
_TOMB_MAGIC = b"OKVT"
_TOMB_HEAD = struct.Struct("<4sIII48x")
assert _TOMB_HEAD.size == BODY_HEAD
_SEG_CRCS = struct.Struct("<4s16xII32xI")
_U32 = struct.Struct("<I")  # segment header (docs/format.md): magic, stored @20, crc @24, hcrc @60


class RecordTagMismatch(HeaderChecksumMismatch):
    """A record or superblock whose keyed tag does not verify: damaged, or not written by this Manager."""


class ShardKey:
    """A shard's secret, as the keyed BLAKE2b hashers of its records and its superblock. The secret never
    leaves the shard file (mode 0600) and this object; engines, which write KV content, cannot read either."""

    __slots__ = ("_record", "_superblock")

    def __init__(self, secret: bytes) -> None:
        if len(secret) != 32:
            raise ValueError("a shard secret is 32 bytes")
        # Keyed once: each tag then costs a copy of the prepared state, two updates and a digest.
        self._record = hashlib.blake2b(key=secret, digest_size=TAG_SIZE, person=b"orbitkv-record")
        self._superblock = hashlib.blake2b(key=secret, digest_size=TAG_SIZE, person=b"orbitkv-superbk")

    def record_tag(self, head: "bytes | memoryview", body_head: "bytes | memoryview") -> bytes:
        """The tag of a record whose header bytes 0..111 are ``head`` and whose body starts with ``body_head``."""
        h = self._record.copy()
        h.update(head)
        h.update(body_head)
        return h.digest()

    def superblock_tag(self, data: "bytes | memoryview") -> bytes:
        h = self._superblock.copy()
        h.update(data)
        return h.digest()


@dataclass(frozen=True, slots=True)
class RecordHeader:
    kind: Kind
    key: ObjectKey | None  # segment records
    generation: int
    body_length: int
    record_length: int
    offset: int
    prev_offset: int
    prev_tag: bytes
    tag: bytes
    scope: Scope
    raw_key: bytes  # the key field as stored (a tombstone's namespace)

    @property
    def end(self) -> int:
        return self.offset + self.record_length


@dataclass(frozen=True, slots=True)
class Tombstone:
    scope: Scope
    namespace: bytes  # scope namespace
    entries: frozenset[bytes]  # packed keys (keys) or namespace + chunk (chunks)

    def covers(self, packed_key: bytes) -> bool:
        if self.scope is Scope.KEYS:
            return packed_key in self.entries
        if self.scope is Scope.CHUNKS:
            return packed_key[:32] in self.entries
        return packed_key[:16] == self.namespace


def record_length(body_length: int) -> int:
    """Bytes a record holding a ``body_length``-byte body occupies on disk (BLOCK-aligned)."""
    return -(-(RECORD_HEADER_SIZE + body_length) // BLOCK) * BLOCK


def pack_record_header_into(dst: "bytearray | memoryview", key: ShardKey, kind: Kind, key_field: bytes,
                            generation: int, body_length: int, offset: int, prev_offset: int, prev_tag: bytes,
                            scope: Scope = Scope.NONE) -> bytes:
    """Write a record header into the first :data:`RECORD_HEADER_SIZE` bytes of ``dst``, whose body
    (at least its first :data:`BODY_HEAD` bytes) is already in place, and answer its tag: one precompiled
    ``pack_into``, one keyed hash and one CRC over ``dst`` itself (the submit path pays this per record,
    so no helper calls)."""
    if not 1 <= generation <= GEN_MAX:
        raise LengthMismatch(f"generation {generation} outside 1..{GEN_MAX}")
    mv = memoryview(dst)
    _STRUCT.pack_into(mv, 0, MAGIC, VERSION, kind, scope, key_field, generation, body_length,
                      -(-(RECORD_HEADER_SIZE + body_length) // BLOCK) * BLOCK, offset, prev_offset, prev_tag, NO_TAG, 0)
    h = key._record.copy()
    h.update(mv[:TAG_AT])
    h.update(mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES])
    tag = h.digest()
    mv[TAG_AT:CRC_AT] = tag
    _U32.pack_into(mv, CRC_AT, _crc32c.crc32c(mv[:CRC_AT]))
    return tag


def record_header(key: ShardKey, kind: Kind, key_field: bytes, generation: int, body_head: bytes,
                  body_length: int, offset: int, prev_offset: int, prev_tag: bytes,
                  scope: Scope = Scope.NONE) -> tuple[bytes, bytes]:
    """``(header bytes, tag)`` of a record whose body starts with ``body_head`` (the cuFile direct path
    builds the header on the host; the body is in device memory)."""
    if len(body_head) != BODY_HEAD:
        raise LengthMismatch(f"a body head is {BODY_HEAD} bytes, not {len(body_head)}")
    buf = bytearray(RECORD_HEAD_BYTES)
    buf[RECORD_HEADER_SIZE:] = body_head
    tag = pack_record_header_into(buf, key, kind, key_field, generation, body_length, offset, prev_offset,
                                  prev_tag, scope)
    return bytes(buf[:RECORD_HEADER_SIZE]), tag


def parse_record_header(buf: "bytes | memoryview") -> RecordHeader:
    """Decode and structurally validate a record header (its tag is checked by :func:`verify_record_tag`)."""
    mv = memoryview(buf)
    if len(mv) < RECORD_HEADER_SIZE:
        raise TruncatedSegment(f"record header needs {RECORD_HEADER_SIZE} bytes, {len(mv)} present")
    magic, version, kind, scope, key, gen, body_len, rec_len, offset, prev_off, prev_tag, tag, crc = \
        _STRUCT.unpack_from(mv)
    if magic != MAGIC:
        raise BadMagic("not a record header")
    if version != VERSION:
        raise UnsupportedVersion(f"record version {version} (this build reads {VERSION})")
    if _crc32c.crc32c(mv[:CRC_AT]) != crc:
        raise HeaderChecksumMismatch("record header CRC32C mismatch")
    k = _KINDS.get(kind)
    s = _SCOPES.get(scope)
    if k is None or s is None or (k is Kind.SEGMENT) != (s is Scope.NONE):
        raise UnknownFormat(f"record kind {kind}, scope {scope}")
    if bytes(mv[_FIELDS.size:TAG_AT]) != bytes(TAG_AT - _FIELDS.size):
        raise UnknownFormat("reserved record header bytes are not zero")
    limit = HEADER_SIZE + MAX_STORED_BYTES if k is Kind.SEGMENT else BODY_HEAD + MAX_TOMBSTONE_BODY
    if not BODY_HEAD <= body_len <= limit or rec_len != record_length(body_len):
        raise LengthMismatch(f"record lengths do not add up (body {body_len}, record {rec_len})")
    if not 1 <= gen <= GEN_MAX:
        raise LengthMismatch(f"generation {gen} outside 1..{GEN_MAX}")
    if offset % BLOCK or (prev_off != NO_PREV and prev_off % BLOCK):
        raise LengthMismatch("record offsets are not block-aligned")
    okey = None
    if k is Kind.SEGMENT:
        try:
            okey = ObjectKey.unpack(key)
        except ValueError as e:  # a role this build does not know
            raise UnknownFormat(f"bad key in record header: {e}") from None
        if key[35]:
            raise UnknownFormat("key padding is not zero")
    elif key[16 if s is Scope.NAMESPACE else 0:] != bytes(PACKED_SIZE - (16 if s is Scope.NAMESPACE else 0)):
        raise UnknownFormat("tombstone key field carries stray bytes")
    return RecordHeader(k, okey, gen, body_len, rec_len, offset, prev_off, prev_tag, tag, s, key)


def verify_record_tag(buf: "bytes | memoryview", key: ShardKey) -> None:
    """Check the tag of the record at the start of ``buf`` (at least :data:`RECORD_HEAD_BYTES`)."""
    mv = memoryview(buf)
    if len(mv) < RECORD_HEAD_BYTES:
        raise TruncatedSegment(f"a record's head needs {RECORD_HEAD_BYTES} bytes, {len(mv)} present")
    if not hmac.compare_digest(key.record_tag(mv[:TAG_AT], mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES]),
                               mv[TAG_AT:CRC_AT]):
        raise RecordTagMismatch("record tag does not verify")


def check_segment_body(rh: RecordHeader, body: "bytes | memoryview") -> SegmentHeader:
    """Validate a segment record's body in full (segment header fields, lengths, payload CRC, and that the
    segment header names the record key's layer and role). Used by recovery and inspection."""
    sh, _ = parse_segment(memoryview(body)[:rh.body_length])  # a body cut short: TruncatedSegment
    if rh.key is None or sh.layer != rh.key.layer or sh.role != rh.key.role:
        raise SegmentError("segment header layer/role disagree with the record key")
    return sh


def tombstone_body(scope: Scope, entries: "list[bytes] | tuple[bytes, ...]") -> bytes:
    """The body of a tombstone of ``scope`` over ``entries`` (each :data:`ENTRY_SIZE` bytes)."""
    size = ENTRY_SIZE[scope]
    if any(len(e) != size for e in entries) or (scope is Scope.NAMESPACE and entries):
        raise LengthMismatch(f"tombstone entries of scope {scope.name} are {size} bytes each")
    data = b"".join(entries)
    if len(data) > MAX_TOMBSTONE_BODY:
        raise LengthMismatch("tombstone too large: split its entries")
    return _TOMB_HEAD.pack(_TOMB_MAGIC, len(entries), size, _crc32c.crc32c(data)) + data


def parse_tombstone(rh: RecordHeader, body: "bytes | memoryview") -> Tombstone:
    """Validate a tombstone record's body (head, entry size, count, entries CRC32C)."""
    mv = memoryview(body)
    if len(mv) < rh.body_length:
        raise TruncatedSegment(f"tombstone body needs {rh.body_length} bytes, {len(mv)} present")
    magic, count, size, crc = _TOMB_HEAD.unpack_from(mv)
    if magic != _TOMB_MAGIC or bytes(mv[16:BODY_HEAD]) != bytes(BODY_HEAD - 16):
        raise BadMagic("not a tombstone body")
    if size != ENTRY_SIZE[rh.scope] or BODY_HEAD + count * size != rh.body_length:
        raise LengthMismatch(f"tombstone of {count} x {size} bytes in a {rh.body_length}-byte body")
    data = bytes(mv[BODY_HEAD:rh.body_length])
    if _crc32c.crc32c(data) != crc:
        raise PayloadChecksumMismatch("tombstone entries CRC32C mismatch")
    entries = frozenset(data[i:i + size] for i in range(0, len(data), size)) if size else frozenset()
    return Tombstone(rh.scope, rh.raw_key[:16] if rh.scope is Scope.NAMESPACE else b"", entries)


def write_record_body(dst: memoryview, body: "bytes | memoryview") -> int:
    """Lay ``body`` and its zero padding after the header space of ``dst``; return the record length.
    The header follows (:func:`pack_record_header_into`) once the generation and place are known, so the
    copy runs before the writer takes any lock."""
    n = len(body)
    rec_len = record_length(n)
    end = RECORD_HEADER_SIZE + n
    if n >= _GIL_FREE_COPY:
        # ctypes.memmove releases the GIL: readers and the writeback thread run during a large copy.
        src = np.frombuffer(body, dtype=np.uint8)
        ctypes.memmove(np.frombuffer(dst, dtype=np.uint8).ctypes.data + RECORD_HEADER_SIZE, src.ctypes.data, n)
    else:
        dst[RECORD_HEADER_SIZE:end] = body
    # Padding is zeroed explicitly: staging buffers are reused and must not leak old bytes to disk.
    dst[end:rec_len] = _ZEROS[:rec_len - end]
    return rec_len


def lay_record_body(dst: Any, segment: Any) -> int:
    """:func:`write_record_body` for 1-D uint8 arrays of one array module (numpy, or CuPy: then the copy
    and the zeroing are device operations queued on the current stream). Returns the record length."""
    n = int(segment.nbytes)
    rec_len = record_length(n)
    if int(dst.nbytes) < rec_len:
        raise LengthMismatch(f"record of {rec_len} bytes does not fit a {int(dst.nbytes)}-byte buffer")
    end = RECORD_HEADER_SIZE + n
    dst[RECORD_HEADER_SIZE:end] = segment.reshape(-1).view(dst.dtype)
    # Zeroed explicitly for the same reason as write_record_body: staging buffers are reused.
    dst[end:rec_len] = 0
    return rec_len


def put_record_header(dst: Any, header: bytes) -> None:
    """Write ``header`` (:func:`record_header`) into the first bytes of a numpy or CuPy uint8 array."""
    h = np.frombuffer(header, dtype=np.uint8)
    if isinstance(dst, np.ndarray):
        dst[:RECORD_HEADER_SIZE] = h
    else:  # a device array: one small host-to-device copy
        dst[:RECORD_HEADER_SIZE].set(h)


def lay_record(dst: Any, segment: Any, header: bytes) -> int:
    """A whole record (``header`` from :func:`record_header`, ``segment``, zero padding) into ``dst``;
    byte for byte what :func:`write_record_body` and :func:`pack_record_header_into` lay into a staging
    buffer. Returns the record length."""
    rec_len = lay_record_body(dst, segment)
    put_record_header(dst, header)
    return rec_len


def _check_head(mv: memoryview, offset: int, packed_key: bytes, generation: int, segment_length: int,
                payload_crc: int) -> None:
    """The segment record at the start of ``mv`` (at least :data:`RECORD_HEAD_BYTES`): its header CRC, its
    fields against what the index holds, and its segment header: CRC, length, and the payload CRC32C the
    index recorded when the segment was submitted (or recovered)."""
    # Fields are unpacked in place (no copies): this runs once per demand-read record.
    magic, version, kind, _, k, gen, body_len, rec_len, off, _, _ = _FIELDS.unpack_from(mv)
    if magic != MAGIC or version != VERSION or kind != Kind.SEGMENT:
        raise BadMagic("not a segment record header")
    if (k != packed_key or gen != generation or body_len != segment_length or off != offset
            or rec_len != record_length(segment_length)):
        raise SegmentError("record header names another key, generation, length or place")
    if _crc32c.crc32c(mv[:CRC_AT]) != _U32.unpack_from(mv, CRC_AT)[0]:
        raise HeaderChecksumMismatch("record header CRC32C mismatch")
    smagic, stored, pcrc, hcrc = _SEG_CRCS.unpack_from(mv, RECORD_HEADER_SIZE)
    if smagic != SEGMENT_MAGIC:
        raise BadMagic("not a segment header")
    if _crc32c.crc32c(mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES - 4]) != hcrc:
        raise HeaderChecksumMismatch("segment header CRC32C mismatch")
    if HEADER_SIZE + stored != segment_length:
        raise LengthMismatch("segment length disagrees with the record")
    if pcrc != payload_crc:
        raise SegmentError("segment header names another payload than the one written for this record")


def verify_record(buf: "bytes | memoryview", offset: int, packed_key: bytes, generation: int, segment_length: int,
                  payload_crc: int) -> memoryview:
    """The demand-read check of a record whose place, key, generation, length and payload CRC32C the index
    knows: the header CRC, the header fields, the segment header's CRC and length, its payload CRC32C
    against the index's, the payload against it. The segment's field semantics were validated when it was
    admitted (and the Manager parses it again). Returns the segment bytes; raises a ``SegmentError``
    subclass."""
    mv = memoryview(buf)
    end = RECORD_HEADER_SIZE + segment_length
    if len(mv) < end:
        raise TruncatedSegment(f"record needs {end} bytes, {len(mv)} present")
    _check_head(mv, offset, packed_key, generation, segment_length, payload_crc)
    seg = mv[RECORD_HEADER_SIZE:end]
    # The CRC keeps the GIL: for a demand read, handing the GIL away for ~100 us of CRC and waiting to get
    # it back behind a busy writeback thread costs far more (up to the 5 ms switch interval).
    if _crc32c.crc32c(seg[HEADER_SIZE:], gil_release_mode=0) != payload_crc:
        raise PayloadChecksumMismatch("payload CRC32C mismatch")
    return seg


def verify_record_head(head: "bytes | memoryview", offset: int, packed_key: bytes, generation: int,
                       segment_length: int, payload_crc: int) -> None:
    """:func:`verify_record` without the payload CRC32C, over a record's first :data:`RECORD_HEAD_BYTES`
    bytes: a device read copies only these to the host, and the GPU checks the payload CRC32C (the one
    checked here against the index) when it decodes. Raises a ``SegmentError`` subclass."""
    mv = memoryview(head)
    if len(mv) < RECORD_HEAD_BYTES:
        raise TruncatedSegment(f"record head needs {RECORD_HEAD_BYTES} bytes, {len(mv)} present")
    _check_head(mv, offset, packed_key, generation, segment_length, payload_crc)
    # The consumer sees only this header before decoding: its fields must parse and name the record's key.
    sh = parse_header(mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES])
    layer, role = key_layer_role(packed_key)
    if sh.layer != layer or sh.role != role:
        raise SegmentError("segment header layer/role disagree with the record key")
