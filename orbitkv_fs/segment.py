"""The segment: OrbitKV-FS's unit of encoding, on disk and on the wire.

A segment is a fixed 64-byte little-endian header followed by its payload. ``docs/format.md`` is the
normative description; this module is its only implementation. Primitives:

* :func:`pack_header` (:func:`pack_header_into` a buffer) / :func:`parse_header` -- header bytes <->
  :class:`SegmentHeader`, fully validated; :class:`HeaderTemplates` parses headers that differ only in
  their payload CRC through one validated template each.
* :func:`build_segment` -- header + payload bytes, CRC32C computed here.
* :data:`HEADER_DTYPE`, :func:`header_row`, :func:`header_crcs` (:func:`header_crc_tables`), :func:`fixed_words` --
  a batch's headers as one numpy array of rows: a validated template row per distinct header, the payload
  CRCs set as a column and every header's own CRC32C computed at once (the CRC is affine in the payload-CRC
  field, so it is the template's CRC combined with four table lookups; the bytes are exactly
  :func:`pack_header`'s).
* :func:`parse_segment` -- validate a whole segment (header, lengths, payload CRC) and return a view
  of its payload.

Invariants:

* Parsing never trusts a length before checking it against the bounds and the buffer it came in;
  nothing is allocated from an untrusted length.
* Every failure is a distinct subclass of :class:`~orbitkv_fs.errors.SegmentError`; no other exception
  escapes :func:`parse_header` or :func:`parse_segment` for any ``bytes``-like input.
* The header covers itself with a CRC32C (bytes 0..59) and the payload with another.
"""

from __future__ import annotations

import enum
import struct

import crc32c as _crc32c
import ml_dtypes
import msgspec
import numpy as np

from .errors import (
    BadMagic,
    HeaderChecksumMismatch,
    LengthMismatch,
    PayloadChecksumMismatch,
    TruncatedSegment,
    UnknownFormat,
    UnsupportedVersion,
)

MAGIC = b"OKVS"
HEADER_VERSION = 1
HEADER_SIZE = 64
#: Encoded (non-raw) segments cover at most this many source bytes.
MAX_SOURCE_BYTES = 16 << 20
#: No segment, raw or encoded, stores more than this many payload bytes.
MAX_STORED_BYTES = 32 << 20
#: Unit of the residency accounting that decides whether an encoding is worth keeping.
ALIGNMENT = 512
#: An encoding is kept only when its aligned footprint saves at least 1/8 (12.5%).
MIN_SAVING_NUM, MIN_SAVING_DEN = 1, 8

_STRUCT = struct.Struct("<4sHBBBBHHBBIIIIBBB25xI")
assert _STRUCT.size == HEADER_SIZE
_CRC_SPAN = HEADER_SIZE - 4


class Format(enum.IntEnum):
    RAW = 0
    ANS = 1
    FP8 = 2
    TURBOQUANT = 3


class Role(enum.IntEnum):
    OPAQUE = 0
    KEY = 1
    VALUE = 2

    @classmethod
    def parse(cls, role: "str | int | Role") -> "Role":
        if isinstance(role, Role):
            return role
        if isinstance(role, str):
            names = {"opaque": cls.OPAQUE, "key": cls.KEY, "k": cls.KEY, "value": cls.VALUE, "v": cls.VALUE}
            try:
                return names[role.lower()]
            except KeyError:
                raise ValueError(f"unknown role {role!r}; expected opaque, key or value") from None
        return cls(role)


class RawReason(enum.IntEnum):
    """Why a segment was stored raw (0 when raw was simply what the codec is)."""

    NONE = 0
    NOT_SMALLER = 1  # the encoding saved less than 12.5% of the aligned footprint
    TOO_LARGE = 2  # source over MAX_SOURCE_BYTES
    OUT_OF_RANGE = 3  # FP8: a finite value with |x| > 448
    NONFINITE = 4  # FP8/TurboQuant: NaN or infinity in the source
    UNSUPPORTED = 5  # dtype, head_dim, alignment or size the codec does not take
    POLICY = 6  # the caller's policy asked for exact storage (e.g. protected layer)


class AnsType(enum.IntEnum):
    """nvCOMP ANS data type the payload was compressed as."""

    NONE = 0
    BYTES = 1
    FLOAT16 = 2
    FP8 = 3


# Stable on-format dtype codes. Never renumber: they are bytes on disk.
_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.float16),
    4: np.dtype(ml_dtypes.bfloat16),
    5: np.dtype(np.float32),
    6: np.dtype(ml_dtypes.float8_e4m3fn),
    7: np.dtype(ml_dtypes.float8_e5m2),
    8: np.dtype(np.uint16),
    9: np.dtype(np.int16),
    10: np.dtype(np.int32),
    11: np.dtype(np.uint32),
    12: np.dtype(np.float64),
    13: np.dtype(np.int64),
    14: np.dtype(np.uint64),
}
_CODES_BY_DTYPE = {dt: code for code, dt in _DTYPE_CODES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """The on-format code of a numpy dtype; :class:`UnknownFormat` for dtypes the format lacks."""
    try:
        return _CODES_BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise UnknownFormat(f"dtype {np.dtype(dtype)} has no segment dtype code") from None


def dtype_from_code(code: int) -> np.dtype:
    try:
        return _DTYPE_CODES[code]
    except KeyError:
        raise UnknownFormat(f"unknown source dtype code {code}") from None


class SegmentHeader(msgspec.Struct, frozen=True, gc=False):
    """The decoded fields of a segment header. ``payload_crc`` is the CRC32C of the payload bytes.
    (A msgspec Struct: built for every segment a restore touches, it costs a tenth of a frozen dataclass.)"""

    format: Format
    dtype: np.dtype
    original_length: int
    stored_length: int
    payload_crc: int
    role: Role = Role.OPAQUE
    layer: int = 0
    bits: int = 0
    head_dim: int = 0
    sign_version: int = 0
    rotation_seed: int = 0
    codec_version: int = 1
    ans_type: AnsType = AnsType.NONE
    raw_reason: RawReason = RawReason.NONE
    flags: int = 0

    @property
    def nbytes(self) -> int:
        """Header plus payload."""
        return HEADER_SIZE + self.stored_length


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGNMENT`."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def worth_keeping(original_length: int, stored_length: int) -> bool:
    """True when the encoded segment's aligned footprint saves at least 12.5% of the raw one's."""
    raw = aligned(HEADER_SIZE + original_length)
    enc = aligned(HEADER_SIZE + stored_length)
    return enc * MIN_SAVING_DEN <= raw * (MIN_SAVING_DEN - MIN_SAVING_NUM)


def turboquant_record_bytes(head_dim: int, bits: int, role: Role) -> int:
    """Bytes per vector of a TurboQuant payload: FP16 norm (K) or FP16 min + scale (V), then codes."""
    side = 2 if role == Role.KEY else 4
    return side + head_dim * bits // 8


def turboquant_stored_bytes(original_length: int, head_dim: int, bits: int, role: Role) -> int:
    """Payload bytes of a TurboQuant segment of ``original_length`` bytes of 16-bit vectors: a record per
    whole vector (the header check, the GPU engine's slots and the Manager's batch sizing use this)."""
    return original_length // (2 * head_dim) * turboquant_record_bytes(head_dim, bits, role)


TURBOQUANT_HEAD_DIMS = (32, 64, 128, 256)
TURBOQUANT_BITS = (3, 4)


def crc32c(data: "bytes | bytearray | memoryview | np.ndarray", value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data)).cast("B")
    return _crc32c.crc32c(data, value)


_HALF_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_ZERO_RESERVED = bytes(25)
# value -> member: a dict lookup is several times cheaper than calling the Enum, and parse_header runs for
# every segment a restore touches
_FORMATS = {m.value: m for m in Format}
_ROLES = {m.value: m for m in Role}
_ANS_TYPES = {m.value: m for m in AnsType}
_RAW_REASONS = {m.value: m for m in RawReason}


def _member(table: dict, value: int, what: str):
    try:
        return table[value]
    except KeyError:
        raise UnknownFormat(f"{value} is not a valid {what}") from None


def _check_fields(h: SegmentHeader) -> None:
    """Validate the relations between header fields. Raises the typed errors."""
    if h.stored_length > MAX_STORED_BYTES:
        raise LengthMismatch(f"stored length {h.stored_length} exceeds {MAX_STORED_BYTES}")
    itemsize = h.dtype.itemsize
    if h.original_length % itemsize:
        raise LengthMismatch(f"original length {h.original_length} is not a multiple of {h.dtype} items")
    if h.format == Format.RAW:  # stored == original, and stored is bounded above
        if h.stored_length != h.original_length:
            raise LengthMismatch("raw segment: stored length must equal original length")
        if h.bits or h.head_dim or h.ans_type:
            raise UnknownFormat("raw segment carries codec parameters")
        return
    if h.raw_reason != RawReason.NONE:
        raise UnknownFormat("encoded segment carries a raw reason")
    if h.original_length > MAX_SOURCE_BYTES:
        raise LengthMismatch(f"encoded source length {h.original_length} exceeds {MAX_SOURCE_BYTES}")
    if h.format == Format.FP8:
        if h.dtype not in _HALF_DTYPES:
            raise UnknownFormat(f"fp8 segment of source dtype {h.dtype}")
        if h.bits != 8 or h.head_dim or h.ans_type:
            raise UnknownFormat("fp8 segment with bad codec parameters")
        if h.stored_length * 2 != h.original_length:
            raise LengthMismatch("fp8 segment: stored length must be half the original length")
    elif h.format == Format.TURBOQUANT:
        if h.dtype not in _HALF_DTYPES:
            raise UnknownFormat(f"turboquant segment of source dtype {h.dtype}")
        if h.bits not in TURBOQUANT_BITS or h.head_dim not in TURBOQUANT_HEAD_DIMS:
            raise UnknownFormat(f"turboquant bits={h.bits} head_dim={h.head_dim} not supported")
        if h.role not in (Role.KEY, Role.VALUE) or h.ans_type or h.sign_version != 1:
            raise UnknownFormat("turboquant segment with bad role, ans type or sign version")
        vec_bytes = h.head_dim * 2
        if h.original_length % vec_bytes:
            raise LengthMismatch("turboquant segment: original length is not whole vectors")
        expect = turboquant_stored_bytes(h.original_length, h.head_dim, h.bits, h.role)
        if h.stored_length != expect:
            raise LengthMismatch(f"turboquant segment: stored length {h.stored_length} != {expect}")
    elif h.format == Format.ANS:
        if h.ans_type == AnsType.NONE or h.bits or h.head_dim:
            raise UnknownFormat("ans segment with bad codec parameters")
        if h.stored_length == 0 and h.original_length:
            raise LengthMismatch("ans segment with an empty payload")


_SIZES = struct.Struct("<15xBI")  # the source dtype code and original length, at their header offsets


def peek_source(buf: "bytes | bytearray | memoryview | np.ndarray") -> "tuple[int, int] | None":
    """``(dtype code, original length)`` as the header at the start of ``buf`` claims them, unverified;
    None when ``buf`` is shorter than a header. A caller that must refuse a mismatched request before
    anything is written reads these, and verifies the whole header (:func:`parse_header`) later."""
    if len(buf) < HEADER_SIZE:
        return None
    return _SIZES.unpack_from(buf)


def _fields(h: SegmentHeader) -> tuple:
    """``_STRUCT``'s values of ``h`` (its CRC left 0). Validates ``h`` first."""
    _check_fields(h)
    return (MAGIC, HEADER_VERSION, int(h.format), h.flags, h.bits, int(h.role), h.head_dim, h.layer,
            h.sign_version, dtype_code(h.dtype), h.original_length, h.stored_length, h.payload_crc,
            h.rotation_seed, h.codec_version, int(h.ans_type), int(h.raw_reason), 0)


def pack_header(h: SegmentHeader) -> bytes:
    """The 64 header bytes of ``h``, its own CRC32C included. Validates ``h`` first."""
    body = _STRUCT.pack(*_fields(h))
    return body[:_CRC_SPAN] + struct.pack("<I", _crc32c.crc32c(body[:_CRC_SPAN]))


def pack_header_into(h: SegmentHeader, buf: "bytearray | memoryview | np.ndarray", offset: int = 0) -> None:
    """Write :func:`pack_header`'s 64 bytes into writable ``buf`` at ``offset`` (a segment's slot), with
    no intermediate bytes object."""
    _STRUCT.pack_into(buf, offset, *_fields(h))
    crc = _crc32c.crc32c(memoryview(buf)[offset:offset + _CRC_SPAN])
    _CRC.pack_into(buf, offset + _CRC_SPAN, crc)


_CRC = struct.Struct("<I")
_PAYLOAD_CRC_AT = 24  # offset of payload_crc in _STRUCT


class HeaderTemplates:
    """Headers of segments that differ only in their payload CRC, parsed through a validated template.

    A restore reads many segments of one geometry and codec: their headers share every field but the
    payload CRC. :meth:`parse` checks the header's CRC, then looks its other 56 bytes up among the headers
    :func:`parse_header` validated before; anything else goes through :func:`parse_header` (and its typed
    errors). At most ``limit`` templates are kept (then the cache starts over). Thread-safe (single dict
    operations). (A batch's headers are written as arrays: :func:`header_row`, :func:`header_crcs`.)"""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._seen: dict[bytes, SegmentHeader] = {}

    def parse(self, buf: "bytes | bytearray | memoryview") -> SegmentHeader:
        """:func:`parse_header` of ``buf``, the same header or the same error."""
        raw = bytes(buf[:HEADER_SIZE])
        if len(raw) == HEADER_SIZE and _crc32c.crc32c(raw[:_CRC_SPAN]) == _CRC.unpack_from(raw, _CRC_SPAN)[0]:
            rest = raw[:_PAYLOAD_CRC_AT] + raw[_PAYLOAD_CRC_AT + 4:_CRC_SPAN]
            h0 = self._seen.get(rest)
            if h0 is not None:
                return msgspec.structs.replace(h0, payload_crc=_CRC.unpack_from(raw, _PAYLOAD_CRC_AT)[0])
            h = parse_header(raw)
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[rest] = h
            return h
        return parse_header(buf)


#: The header as a numpy structured dtype (the fields of ``_STRUCT``, little-endian, 64 bytes): a batch of
#: headers is an array of these rows.
HEADER_DTYPE = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("format", "u1"), ("flags", "u1"), ("bits", "u1"), ("role", "u1"),
    ("head_dim", "<u2"), ("layer", "<u2"), ("sign_version", "u1"), ("dtype", "u1"), ("original_length", "<u4"),
    ("stored_length", "<u4"), ("payload_crc", "<u4"), ("rotation_seed", "<u4"), ("codec_version", "u1"),
    ("ans_type", "u1"), ("raw_reason", "u1"), ("reserved", "V25"), ("header_crc", "<u4")])
assert HEADER_DTYPE.itemsize == HEADER_SIZE and HEADER_DTYPE.fields["payload_crc"][1] == _PAYLOAD_CRC_AT


def _crc_tables(at: int) -> np.ndarray:
    """``T[j, b]``: how byte ``b`` at byte ``j`` of the 4-byte field at ``at`` changes a header's own CRC32C
    (CRC32C of equal-length messages is affine: crc(a ^ b) = crc(a) ^ crc(b) ^ crc(zeros))."""
    zeros = bytes(_CRC_SPAN)
    z = _crc32c.crc32c(zeros)
    t = np.empty((4, 256), dtype=np.uint32)
    msg = bytearray(_CRC_SPAN)
    for j in range(4):
        for b in range(256):
            msg[at + j] = b
            t[j, b] = _crc32c.crc32c(msg) ^ z
        msg[at + j] = 0
    return t


_HEADER_CRC_TABLES = _crc_tables(_PAYLOAD_CRC_AT)
_STORED_CRC_TABLES = _crc_tables(HEADER_DTYPE.fields["stored_length"][1])
_HEADER_CRC_TABLES.flags.writeable = _STORED_CRC_TABLES.flags.writeable = False


def header_crc_tables() -> tuple[np.ndarray, np.ndarray]:
    """The tables :func:`header_crcs` combines, for code that writes headers outside numpy (``(4, 256)`` uint32,
    read-only): how each byte of the payload-CRC field and of the stored-length field changes a header's CRC."""
    return _HEADER_CRC_TABLES, _STORED_CRC_TABLES


def _field_crcs(t: np.ndarray, v: np.ndarray) -> np.ndarray:
    return t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24]


def header_row(h: SegmentHeader) -> tuple[np.ndarray, int]:
    """The template of headers like ``h`` but for their payload CRC: :func:`pack_header`'s bytes of ``h``
    with a zero payload CRC, as one :data:`HEADER_DTYPE` row, and the CRC32C of its first 60 bytes.
    Validates ``h`` (raises as :func:`pack_header`)."""
    raw = pack_header(msgspec.structs.replace(h, payload_crc=0))
    return np.frombuffer(raw, dtype=HEADER_DTYPE, count=1).copy(), _crc32c.crc32c(raw[:_CRC_SPAN])


def fixed_words(heads: np.ndarray) -> np.ndarray:
    """Headers ``heads`` (``[n, 64]`` uint8, contiguous) as ``[n, 16]`` uint32 words with their two CRC words
    zeroed: what each header fixes but for its CRCs (a copy). Its bytes key a batch of headers by everything
    but their CRCs."""
    words = heads.view("<u4").reshape(len(heads), HEADER_SIZE // 4).copy()
    words[:, _PAYLOAD_CRC_AT // 4] = 0  # two column stores: a fancy index costs half as much again
    words[:, HEADER_SIZE // 4 - 1] = 0
    return words


def header_crcs(template_crcs: np.ndarray, payload_crcs: np.ndarray, stored_xor: "np.ndarray | None" = None) -> np.ndarray:
    """The header CRC32C of each row whose template (:func:`header_row`) had CRC ``template_crcs[i]``,
    once its payload-CRC field is ``payload_crcs[i]`` (uint32 arrays of one length) and, given
    ``stored_xor``, its stored-length field is the template's XOR ``stored_xor[i]`` (a payload whose length
    the encode found, as ANS's: one template for the class, not one per length)."""
    crcs = template_crcs.astype(np.uint32, copy=False) ^ _field_crcs(_HEADER_CRC_TABLES,
                                                                      payload_crcs.astype(np.uint32, copy=False))
    if stored_xor is not None:
        crcs ^= _field_crcs(_STORED_CRC_TABLES, stored_xor.astype(np.uint32, copy=False))
    return crcs


def parse_header(buf: "bytes | bytearray | memoryview") -> SegmentHeader:
    """Parse and validate the header at the start of ``buf`` (which may hold more bytes)."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    if len(mv) < HEADER_SIZE:
        raise TruncatedSegment(f"{len(mv)} bytes is shorter than the {HEADER_SIZE}-byte header")
    raw = bytes(mv[:HEADER_SIZE])
    if raw[:4] != MAGIC:
        raise BadMagic(f"bad magic {raw[:4]!r}")
    fields = _STRUCT.unpack(raw)
    version = fields[1]
    if version != HEADER_VERSION:
        raise UnsupportedVersion(f"header version {version} (this build reads {HEADER_VERSION})")
    if _crc32c.crc32c(raw[:_CRC_SPAN]) != fields[-1]:
        raise HeaderChecksumMismatch("header CRC32C mismatch")
    (_, _, fmt, flags, bits, role, head_dim, layer, sign_version, dcode, orig, stored, pcrc, seed,
     codec_version, ans_type, raw_reason, _) = fields
    if raw[35:60] != _ZERO_RESERVED:
        raise UnknownFormat("reserved header bytes are not zero")
    h = SegmentHeader(
        format=_member(_FORMATS, fmt, "Format"),
        dtype=dtype_from_code(dcode),
        original_length=orig,
        stored_length=stored,
        payload_crc=pcrc,
        role=_member(_ROLES, role, "Role"),
        layer=layer,
        bits=bits,
        head_dim=head_dim,
        sign_version=sign_version,
        rotation_seed=seed,
        codec_version=codec_version,
        ans_type=_member(_ANS_TYPES, ans_type, "AnsType"),
        raw_reason=_member(_RAW_REASONS, raw_reason, "RawReason"),
        flags=flags,
    )
    if flags:
        raise UnknownFormat(f"unknown header flags {flags:#x}")
    if codec_version != 1:
        raise UnknownFormat(f"codec version {codec_version} (this build reads 1)")
    _check_fields(h)
    return h


def build_segment(h: SegmentHeader, payload: "bytes | bytearray | memoryview | np.ndarray") -> bytes:
    """Header + payload. ``h.payload_crc`` and ``h.stored_length`` are replaced by the payload's."""
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload)).cast("B")
    mv = memoryview(payload).cast("B") if isinstance(payload, memoryview) else memoryview(payload)
    h = msgspec.structs.replace(h, stored_length=len(mv), payload_crc=_crc32c.crc32c(mv))
    return b"".join((pack_header(h), mv))


def parse_segment(
    buf: "bytes | bytearray | memoryview", *, verify_crc: bool = True, exact: bool = True
) -> tuple[SegmentHeader, memoryview]:
    """Validate a whole segment; return its header and a zero-copy view of its payload.

    ``exact`` requires ``buf`` to hold exactly header + payload; otherwise trailing bytes (alignment
    padding) are allowed.
    """
    h = parse_header(buf)
    mv = memoryview(buf).cast("B") if isinstance(buf, memoryview) else memoryview(buf)
    end = HEADER_SIZE + h.stored_length
    if len(mv) < end:
        raise TruncatedSegment(f"payload needs {h.stored_length} bytes, {len(mv) - HEADER_SIZE} present")
    if exact and len(mv) != end:
        raise LengthMismatch(f"{len(mv) - end} bytes after the declared payload")
    payload = mv[HEADER_SIZE:end]
    if verify_crc and _crc32c.crc32c(payload) != h.payload_crc:
        raise PayloadChecksumMismatch("payload CRC32C mismatch")
    return h, payload
