"""The SSD record: how one cached segment sits in a shard file, and the scanner that reads shard files back.

A shard file is a ring of records, each starting on a :data:`BLOCK` (4 KiB) boundary::

    record header (RECORD_HEADER_SIZE bytes) | segment (64-byte segment header + payload) | zero padding

Record header (little endian, :data:`RECORD_HEADER_SIZE` bytes)::

    0   4s   magic "OKVR"
    4   H    version (1)
    6   H    header size (128)
    8   36s  ObjectKey.pack(): namespace(16) chunk(16) layer(u16) role(u8) pad
    44  Q    generation (tier-wide, strictly increasing per write; newest valid generation of a key wins)
    52  I    segment length (64-byte segment header + payload)
    56  I    record length (header + segment + padding, a multiple of BLOCK)
    60  64x  reserved, zero
    124 I    CRC32C of bytes 0..123

Primitives:

* :func:`record_length` -- the aligned footprint of a segment of a given size.
* :func:`pack_record_header` / :func:`parse_record_header` -- header bytes <-> :class:`RecordHeader`;
  :func:`pack_record_header_into` writes one straight into a staging buffer.
* :func:`write_record_body` -- lay a record's segment and zero padding into a buffer (the header follows,
  with :func:`pack_record_header_into`, once its generation is known).
* :func:`record_header`, :func:`lay_record_body`, :func:`put_record_header`, :func:`lay_record` -- the same
  layout into any 1-D uint8 array, numpy or CuPy (the cuFile direct path lays records out in device
  memory; the tests compare the two layouts with numpy buffers).
* :func:`check_record` -- validate a whole record in a buffer (header CRC, key, lengths, full segment parse).
* :func:`verify_record` -- the demand-read check: every CRC and the index's key/generation/length.
* :func:`verify_record_head` -- the same check without the payload CRC, over the first
  :data:`RECORD_HEAD_BYTES` bytes only (device reads: the payload CRC32C is checked on the GPU).
* :func:`scan` -- walk a shard image (an mmap or any buffer) and classify every record; shared by
  recovery and ``orbitkv-inspect``.

Invariants: nothing here trusts a length before checking it against the buffer; every failure is a
:class:`~orbitkv_fs.errors.SegmentError` subclass (or the scan reports it), never another exception.
"""

from __future__ import annotations

import ctypes
import enum
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import crc32c as _crc32c
import numpy as np

from ...errors import (
    BadMagic,
    HeaderChecksumMismatch,
    LengthMismatch,
    PayloadChecksumMismatch,
    SegmentError,
    TruncatedSegment,
    UnsupportedVersion,
)
from ...keys import PACKED_SIZE, ObjectKey, key_layer_role
from ...segment import HEADER_SIZE, MAX_STORED_BYTES, SegmentHeader, crc32c, parse_header, parse_segment
from ...segment import MAGIC as SEGMENT_MAGIC

MAGIC = b"OKVR"
VERSION = 1
BLOCK = 4096
RECORD_HEADER_SIZE = 128
#: Record header and segment header: what a device read copies to the host to check a record.
RECORD_HEAD_BYTES = RECORD_HEADER_SIZE + HEADER_SIZE
#: The largest record a segment can need (header + biggest segment, aligned).
MAX_RECORD = -(-(RECORD_HEADER_SIZE + HEADER_SIZE + MAX_STORED_BYTES) // BLOCK) * BLOCK

_GIL_FREE_COPY = 256 << 10
_STRUCT = struct.Struct(f"<4sHH{PACKED_SIZE}sQII64xI")
assert _STRUCT.size == RECORD_HEADER_SIZE
_CRC_SPAN = RECORD_HEADER_SIZE - 4
_U32 = struct.Struct("<I")
_ZEROS = memoryview(bytes(BLOCK))  # padding never reaches a whole block


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: ObjectKey
    generation: int
    segment_length: int
    record_length: int


def record_length(segment_length: int) -> int:
    """Bytes a record holding a ``segment_length``-byte segment occupies on disk (BLOCK-aligned)."""
    return -(-(RECORD_HEADER_SIZE + segment_length) // BLOCK) * BLOCK


def pack_record_header(h: RecordHeader) -> bytes:
    buf = bytearray(RECORD_HEADER_SIZE)
    pack_record_header_into(buf, h.key.pack(), h.generation, h.segment_length, h.record_length)
    return bytes(buf)


def pack_record_header_into(dst: "bytearray | memoryview", packed_key: bytes, generation: int,
                            segment_length: int, record_length: int) -> None:
    """Write a record header (CRC included) into the first :data:`RECORD_HEADER_SIZE` bytes of ``dst``:
    one precompiled ``pack_into`` and one CRC over ``dst`` itself, no intermediate bytes (the submit path
    of small records pays this per record)."""
    _STRUCT.pack_into(dst, 0, MAGIC, VERSION, RECORD_HEADER_SIZE, packed_key, generation, segment_length,
                      record_length, 0)
    _U32.pack_into(dst, _CRC_SPAN, _crc32c.crc32c(memoryview(dst)[:_CRC_SPAN]))


def parse_record_header(buf: "bytes | memoryview") -> RecordHeader:
    """Validate and decode a record header (not the segment after it)."""
    mv = memoryview(buf)
    if len(mv) < RECORD_HEADER_SIZE:
        raise TruncatedSegment(f"record header needs {RECORD_HEADER_SIZE} bytes, {len(mv)} present")
    raw = bytes(mv[:RECORD_HEADER_SIZE])
    magic, version, hsize, key, gen, seg_len, rec_len, crc = _STRUCT.unpack(raw)
    if magic != MAGIC:
        raise BadMagic("not a record header")
    if crc32c(raw[:_CRC_SPAN]) != crc:
        raise HeaderChecksumMismatch("record header CRC32C mismatch")
    if version != VERSION or hsize != RECORD_HEADER_SIZE:
        raise UnsupportedVersion(f"record version {version}, header size {hsize}")
    if not HEADER_SIZE <= seg_len <= HEADER_SIZE + MAX_STORED_BYTES or rec_len != record_length(seg_len):
        raise LengthMismatch(f"record lengths do not add up (segment {seg_len}, record {rec_len})")
    try:
        okey = ObjectKey.unpack(key)
    except ValueError as e:  # role or layer this build does not know
        raise LengthMismatch(f"bad key in record header: {e}") from None
    return RecordHeader(okey, gen, seg_len, rec_len)


def write_record_body(dst: memoryview, segment: "bytes | memoryview") -> int:
    """Lay ``segment`` and its zero padding after the header space of ``dst``; return the record length.
    The header is written separately (:func:`pack_record_header_into`) once the generation is known, so
    that the copy can run before the writer takes any lock."""
    seg_len = len(segment)
    rec_len = record_length(seg_len)
    end = RECORD_HEADER_SIZE + seg_len
    if seg_len >= _GIL_FREE_COPY:
        # ctypes.memmove releases the GIL: readers and the writeback thread run during a large copy.
        src = np.frombuffer(segment, dtype=np.uint8)
        ctypes.memmove(np.frombuffer(dst, dtype=np.uint8).ctypes.data + RECORD_HEADER_SIZE, src.ctypes.data, seg_len)
    else:
        dst[RECORD_HEADER_SIZE:end] = segment
    # Padding is zeroed explicitly: staging buffers are reused and must not leak old bytes to disk.
    dst[end:rec_len] = _ZEROS[:rec_len - end]
    return rec_len


def record_header(packed_key: bytes, generation: int, segment_length: int) -> bytes:
    """The record header of a ``segment_length``-byte segment (CRC included)."""
    buf = bytearray(RECORD_HEADER_SIZE)
    pack_record_header_into(buf, packed_key, generation, segment_length, record_length(segment_length))
    return bytes(buf)


def lay_record_body(dst: Any, segment: Any) -> int:
    """:func:`write_record_body` for 1-D uint8 arrays of one array module (numpy, or CuPy: then the copy
    and the zeroing are device operations queued on the current stream). Returns the record length."""
    seg_len = int(segment.nbytes)
    rec_len = record_length(seg_len)
    if int(dst.nbytes) < rec_len:
        raise LengthMismatch(f"record of {rec_len} bytes does not fit a {int(dst.nbytes)}-byte buffer")
    end = RECORD_HEADER_SIZE + seg_len
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


def check_record(buf: "bytes | memoryview") -> tuple[RecordHeader, SegmentHeader, memoryview]:
    """Validate the record at the start of ``buf`` in full (record header, segment header fields, payload
    CRC); return its header, segment header and segment bytes. Used by recovery and inspection."""
    rh = parse_record_header(buf)
    mv = memoryview(buf)
    end = RECORD_HEADER_SIZE + rh.segment_length
    if len(mv) < end:
        raise TruncatedSegment(f"record needs {end} bytes, {len(mv)} present")
    seg = mv[RECORD_HEADER_SIZE:end]
    sh, _ = parse_segment(seg)
    if sh.layer != rh.key.layer or sh.role != rh.key.role:
        raise SegmentError("segment header layer/role disagree with the record key")
    return rh, sh, seg


_SEG_CRCS = struct.Struct("<4s16xII32xI")  # segment header (docs/format.md): magic, stored @20, crc @24, hcrc @60


def _check_head(mv: memoryview, packed_key: bytes, generation: int, segment_length: int) -> int:
    """Record header CRC and fields, segment header CRC and length of the record at the start of ``mv``
    (at least :data:`RECORD_HEAD_BYTES`); returns the payload CRC the segment header names."""
    # Fields are unpacked and CRC'd in place (no copies): this runs once per demand-read record.
    magic, _, _, key, gen, seg_len, _, crc = _STRUCT.unpack_from(mv)
    if magic != MAGIC:
        raise BadMagic("not a record header")
    if _crc32c.crc32c(mv[:_CRC_SPAN]) != crc:
        raise HeaderChecksumMismatch("record header CRC32C mismatch")
    if key != packed_key or gen != generation or seg_len != segment_length:
        raise SegmentError("record header names another key, generation or length")
    seg = mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES]
    smagic, stored, pcrc, hcrc = _SEG_CRCS.unpack_from(seg)
    if smagic != SEGMENT_MAGIC:
        raise BadMagic("not a segment header")
    if _crc32c.crc32c(seg[:HEADER_SIZE - 4]) != hcrc:
        raise HeaderChecksumMismatch("segment header CRC32C mismatch")
    if HEADER_SIZE + stored != segment_length:
        raise LengthMismatch("segment length disagrees with the record")
    return pcrc


def verify_record(buf: "bytes | memoryview", packed_key: bytes, generation: int, segment_length: int) -> memoryview:
    """The demand-read check of a record whose key, generation and length the index knows: record header
    CRC and fields, segment header CRC and length, payload CRC32C. Every byte read is covered by a CRC;
    the segment's field semantics were validated when it was admitted (and the Manager parses it again).
    Returns the segment bytes; raises a ``SegmentError`` subclass."""
    mv = memoryview(buf)
    end = RECORD_HEADER_SIZE + segment_length
    if len(mv) < end:
        raise TruncatedSegment(f"record needs {end} bytes, {len(mv)} present")
    pcrc = _check_head(mv, packed_key, generation, segment_length)
    seg = mv[RECORD_HEADER_SIZE:end]
    # The CRC keeps the GIL: for a demand read, handing the GIL away for ~100 us of CRC and waiting to get
    # it back behind a busy writeback thread costs far more (up to the 5 ms switch interval).
    if _crc32c.crc32c(seg[HEADER_SIZE:], gil_release_mode=0) != pcrc:
        raise PayloadChecksumMismatch("payload CRC32C mismatch")
    return seg


def verify_record_head(head: "bytes | memoryview", packed_key: bytes, generation: int, segment_length: int) -> None:
    """:func:`verify_record` without the payload CRC32C, over a record's first :data:`RECORD_HEAD_BYTES`
    bytes: a device read copies only these to the host, and the GPU checks the payload CRC32C when it
    decodes. Raises a ``SegmentError`` subclass."""
    mv = memoryview(head)
    if len(mv) < RECORD_HEAD_BYTES:
        raise TruncatedSegment(f"record head needs {RECORD_HEAD_BYTES} bytes, {len(mv)} present")
    _check_head(mv, packed_key, generation, segment_length)
    # The consumer sees only this header before decoding: its fields must parse and name the record's key.
    sh = parse_header(mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES])
    layer, role = key_layer_role(packed_key)
    if sh.layer != layer or sh.role != role:
        raise SegmentError("segment header layer/role disagree with the record key")


class Status(enum.Enum):
    VALID = "valid"
    CORRUPT = "corrupt"  # a record header that validates, a segment that does not (or a damaged header)
    TORN = "torn"  # like CORRUPT, but among the newest generations: a write that never completed


@dataclass(frozen=True, slots=True)
class ScanEntry:
    offset: int
    length: int  # bytes the scanner skipped for this entry (the record, or one BLOCK for a bad header)
    status: Status
    header: RecordHeader | None
    segment: SegmentHeader | None
    error: str = ""


def scan(image: "bytes | memoryview", *, in_flight_window: int = 1024,
         progress: Callable[[int], None] | None = None) -> Iterator[ScanEntry]:
    """Classify every record of a shard image, in file order.

    Zeroed or foreign blocks are skipped silently (a fresh ring is all zeros). A block whose first bytes
    are the record magic but whose header does not validate is CORRUPT. A valid header with a bad segment
    is TORN when its generation lies within ``in_flight_window`` of the newest generation seen in the image
    (only the last writes can have been in flight at a crash), CORRUPT otherwise. ``progress`` gets the
    offset reached every few MiB.
    """
    mv = memoryview(image).cast("B") if isinstance(image, memoryview) else memoryview(image)
    size = len(mv) - len(mv) % BLOCK
    # Skipping empty or foreign space block by block is slow in Python; the buffer's own find() (mmap,
    # bytes) jumps to the next magic at C speed. Only when the view covers its whole object.
    base = image.obj if isinstance(image, memoryview) else image
    find = getattr(base, "find", None)
    if find is not None and getattr(base, "__len__", None) is not None and len(base) != len(mv):
        find = None
    pending: list[ScanEntry] = []  # body failures, classified once the newest generation is known
    newest = 0
    out: list[ScanEntry] = []
    off = 0
    next_report = 0
    while off < size:
        if progress is not None and off >= next_report:
            progress(off)
            next_report = off + (8 << 20)
        if mv[off:off + 4] != MAGIC:
            if find is None:
                off += BLOCK
                continue
            nxt = find(MAGIC, off + 1)
            if nxt < 0:
                break
            off = -(-nxt // BLOCK) * BLOCK  # the block boundary at or after the match
            continue
        try:
            rh = parse_record_header(mv[off:off + RECORD_HEADER_SIZE])
        except SegmentError as e:
            out.append(ScanEntry(off, BLOCK, Status.CORRUPT, None, None, f"record header: {e}"))
            off += BLOCK
            continue
        newest = max(newest, rh.generation)
        if off + rh.record_length > size:
            entry = ScanEntry(off, BLOCK, Status.CORRUPT, rh, None, "record runs past the end of the file")
            pending.append(entry)
            out.append(entry)
            off += BLOCK
            continue
        try:
            _, sh, _ = check_record(mv[off:off + rh.record_length])
        except SegmentError as e:
            entry = ScanEntry(off, BLOCK, Status.CORRUPT, rh, None, f"segment: {e}")
            pending.append(entry)
            out.append(entry)
            # A damaged body may hide the next record's header anywhere after its first block.
            off += BLOCK
            continue
        out.append(ScanEntry(off, rh.record_length, Status.VALID, rh, sh))
        off += rh.record_length
    if progress is not None:
        progress(size)
    torn = {id(e) for e in pending if e.header is not None and e.header.generation > newest - in_flight_window}
    for e in out:
        if id(e) in torn:
            yield ScanEntry(e.offset, e.length, Status.TORN, e.header, None, e.error)
        else:
            yield e
