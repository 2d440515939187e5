"""Segment checks the Manager makes before it serves or admits bytes.

Primitives: :func:`_verify` (header, key's layer/role, payload CRC32C), :func:`_verify_header` (the same
without the payload CRC, for bytes a tier validated a moment ago), :func:`_verify_headers` (that of a
batch, as arrays; :func:`_header_rows` / :func:`_header_rows_at` gather its headers, :func:`header_fields`
reads them as a structured array, :func:`header_of` makes a passed row's header), :func:`_check_keys` (16-byte
chunk keys),
:data:`_HEADERS` (parsed-header templates), :data:`_REP_NAMES` (Format value -> representation name).

Invariants: every check raises :class:`~orbitkv_fs.errors.SegmentError` (never returns a half-checked
header); a segment whose header names another layer or role than its key is refused.
"""

from __future__ import annotations

from typing import Sequence

import crc32c as _crc32c
import msgspec
import numpy as np

from ..errors import SegmentError, UnknownFormat
from ..keys import key_layer_role
from ..segment import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_STORED_BYTES,
    Format,
    HeaderTemplates,
    Role,
    SegmentHeader,
    fixed_words,
    header_crcs,
    parse_header,
    parse_segment,
)
from .api import RequestError

_REP_NAMES = {int(f): f.name.lower() for f in Format}
_PCRC = HEADER_DTYPE.fields["payload_crc"][1]  # where the payload CRC lies in a header (and in _FIXED's gap)


def _check_keys(chunks: Sequence[bytes]) -> None:
    """Raises :class:`RequestError` naming the first of ``chunks`` that is not a 16-byte key."""
    for i, c in enumerate(chunks):
        if not isinstance(c, bytes) or len(c) != 16:
            raise RequestError(f"chunks[{i}]: a chunk key is 16 bytes")


def _check_key(kb: bytes, h: SegmentHeader) -> None:
    layer, role = key_layer_role(kb)
    if h.layer != layer or h.role != role:
        raise UnknownFormat(f"segment is layer {h.layer}/{h.role.name}, the key says {layer}/{Role(role).name}")


def _verify(kb: bytes, blob) -> SegmentHeader:
    """Full validation of a segment claimed to be the object ``kb``. Raises SegmentError."""
    h, _ = parse_segment(blob)
    _check_key(kb, h)
    return h


def _verify_header(kb: bytes, blob: bytes) -> SegmentHeader:
    """Header validation of a segment whose payload CRC a tier just checked (prefetched from the SSD tier,
    which verifies every record's CRCs): header CRC and fields, the key's layer/role, the length. Raises
    SegmentError. Spares a second CRC pass over the payload."""
    h = _HEADERS.parse(blob)
    _check_key(kb, h)
    if len(blob) != HEADER_SIZE + h.stored_length:
        raise SegmentError(f"segment of {len(blob)} bytes, its header says {HEADER_SIZE + h.stored_length}")
    return h


#: The restore's header checks: a batch's headers differ only in their payload CRC.
_HEADERS = HeaderTemplates()

#: Header bytes a template fixes: all but the payload CRC (24..27) and the header's own CRC (60..63).
_FIXED = np.r_[0:24, 28:60]
_ROW = np.arange(HEADER_SIZE, dtype=np.int64)
#: Templates _verify_headers validated: fixed header bytes -> (header with payload CRC 0, CRC32C of its
#: first 60 bytes). Bounded: cleared when full (corrupt headers are never added).
_TEMPLATES: dict[bytes, tuple[SegmentHeader, int]] = {}
_TEMPLATES_KEPT = 4096
#: The same per batch: the distinct fixed bytes of a batch's headers, concatenated -> _templates_of's answer.
_BATCH_TEMPLATES: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, list[SegmentHeader]]] = {}
_BATCHES_KEPT = 256


def _header_rows_at(buf: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The 64 header bytes at each of ``offsets`` of byte array ``buf`` (an arena), as ``[n, 64]`` uint8,
    in one gather: of 64-byte rows where every offset is a multiple of 64 (arena extents are), else of
    bytes."""
    at = np.asarray(offsets, dtype=np.int64)
    if not (at % HEADER_SIZE).any():
        return buf[:len(buf) // HEADER_SIZE * HEADER_SIZE].reshape(-1, HEADER_SIZE)[at // HEADER_SIZE]
    return buf[at[:, None] + _ROW]


def _header_rows(blobs: Sequence) -> np.ndarray:
    """The first 64 bytes of each of ``blobs`` as ``[n, 64]`` uint8; zeros (no magic: a failing header)
    for a blob shorter than a header."""
    zero = bytes(HEADER_SIZE)
    raw = b"".join([bytes(memoryview(b)[:HEADER_SIZE]) if len(b) >= HEADER_SIZE else zero for b in blobs])
    return np.frombuffer(raw, dtype=np.uint8).reshape(len(blobs), HEADER_SIZE)


def header_fields(blobs: Sequence) -> np.ndarray:
    """The header fields of each of ``blobs`` as one :data:`~orbitkv_fs.segment.HEADER_DTYPE` array, as
    they stand (unverified: :func:`_verify_headers` says which rows are valid)."""
    return _header_rows(blobs).view(HEADER_DTYPE).reshape(len(blobs))


def _template(fixed: bytes) -> tuple[SegmentHeader, int] | None:
    """The template of headers whose fixed bytes are ``fixed`` (56 bytes), validated by
    :func:`~orbitkv_fs.segment.parse_header` once; None when those fields make no valid header."""
    got = _TEMPLATES.get(fixed)
    if got is None:
        body = fixed[:_PCRC] + bytes(4) + fixed[_PCRC:]
        base = _crc32c.crc32c(body)
        try:
            h0 = parse_header(body + base.to_bytes(4, "little"))
        except SegmentError:
            return None
        if len(_TEMPLATES) >= _TEMPLATES_KEPT:
            _TEMPLATES.clear()
        got = _TEMPLATES[fixed] = (h0, base)
    return got


#: Odd 64-bit multipliers that mix a header's eight words into one (a grouping key, checked after).
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D, 0x94D049BB133111EB], dtype=np.uint64)


#: _distinct_fixed's answers by the batch's header words but for their CRCs: a restore's batches of whole
#: chunks repeat one sequence of headers but for their CRCs (its layers, roles and lengths), and so do later
#: restores of that shape. Bounded: cleared when full.
_GROUPS: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
_GROUPS_KEPT = 64


def _distinct_fixed(heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Headers ``heads`` (``[n, 64]`` uint8) grouped by their fixed bytes (all but the two CRCs): the row of
    each group's first header and each header's group. Grouped on a 64-bit mix of the words; every header is
    then compared with its group's first, and a collision (never seen) regroups on the bytes themselves. A
    sequence of headers seen before is answered from :data:`_GROUPS`."""
    n = len(heads)
    words = fixed_words(heads)
    key = words.tobytes()
    got = _GROUPS.get(key)
    if got is not None:
        return got
    wide = words.view("<u8")
    mixed = np.bitwise_xor.reduce(wide * _MIX, axis=1)
    _, first, inv = np.unique(mixed, return_index=True, return_inverse=True)
    inv = inv.reshape(n)
    if not (wide == wide[first[inv]]).all():
        _, first, inv = np.unique(wide.view(f"V{HEADER_SIZE}").reshape(n), return_index=True, return_inverse=True)
        inv = inv.reshape(n)
    if len(_GROUPS) >= _GROUPS_KEPT:
        _GROUPS.clear()
    for a in (first, inv):
        a.flags.writeable = False  # shared by the batches that meet them
    _GROUPS[key] = (first, inv)
    return first, inv


def _templates_of(fixed: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[SegmentHeader]]:
    """For distinct fixed header bytes ``fixed`` (56 bytes each, one after another): whether each makes a
    valid header, its template's CRC32C and index in the templates answered last (-1 if not valid). A batch
    of a restore meets the same ones as the batch before it: answered from :data:`_BATCH_TEMPLATES` then."""
    got = _BATCH_TEMPLATES.get(fixed)
    if got is None:
        m = len(fixed) // len(_FIXED)
        templates: list[SegmentHeader] = []
        valid = np.zeros(m, dtype=bool)
        bases = np.zeros(m, dtype=np.uint32)
        tid_of = np.full(m, -1, dtype=np.int64)
        for j in range(m):
            t = _template(fixed[j * len(_FIXED):(j + 1) * len(_FIXED)])
            if t is not None:
                valid[j] = True
                bases[j] = t[1]
                tid_of[j] = len(templates)
                templates.append(t[0])
        if len(_BATCH_TEMPLATES) >= _BATCHES_KEPT:
            _BATCH_TEMPLATES.clear()
        for a in (valid, bases, tid_of):
            a.flags.writeable = False  # shared by the batches that meet them
        got = _BATCH_TEMPLATES[fixed] = (valid, bases, tid_of, templates)
    return got[0], got[1], got[2], list(got[3])


def _verify_headers(heads: np.ndarray, layers: np.ndarray, roles: np.ndarray,
                    lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[SegmentHeader]]:
    """:func:`_verify_header` of a batch as arrays: ``heads`` (``[n, 64]`` uint8) the headers, ``layers`` /
    ``roles`` what each one's key names, ``lengths`` each segment's bytes. Every distinct header but for
    its CRCs (and an ANS payload's length, which its codec decides segment by segment) is validated once
    (:func:`_template`), each header's own CRC32C is checked from its template's as an array
    (:func:`~orbitkv_fs.segment.header_crcs`). Answers ``ok`` (rows that :func:`_verify_header` would pass), per
    row its template's index (-1 for an invalid one) and the templates (headers with payload CRC 0). The header
    of an ok row ``i`` is ``templates[tid[i]]`` with ``payload_crc`` and ``stored_length`` ``heads``' fields
    (:func:`header_of`); a row that is not ok fails :func:`_verify_header`, which says why."""
    n = len(heads)
    heads = np.ascontiguousarray(heads, dtype=np.uint8).reshape(n, HEADER_SIZE)
    h = heads.view(HEADER_DTYPE).reshape(n)
    stored = h["stored_length"]
    # An ANS payload's length stands for any other in its template: the one thing a header's fields say of it
    # beyond the template's is its bound (and that it is not empty, which a zero length keeps to its template).
    ans = (h["format"] == int(Format.ANS)) & (stored > 0)
    grouped, xor = heads, None
    if ans.any():
        grouped = heads.copy()
        g = grouped.view(HEADER_DTYPE).reshape(n)
        g["stored_length"][ans] = 1
        xor = stored ^ g["stored_length"]
    first, inv = _distinct_fixed(grouped)
    valid, bases, tid_of, templates = _templates_of(grouped[first][:, _FIXED].tobytes())
    ok = valid[inv]
    ok &= h["header_crc"] == header_crcs(bases[inv], h["payload_crc"], xor)
    ok &= (h["layer"] == layers) & (h["role"] == roles)
    ok &= np.asarray(lengths, dtype=np.int64) == stored.astype(np.int64) + HEADER_SIZE
    if xor is not None:
        ok &= ~ans | (stored <= MAX_STORED_BYTES)
    return ok, tid_of[inv], templates


def header_of(template: SegmentHeader, row: np.ndarray) -> SegmentHeader:
    """The header of a row that :func:`_verify_headers` passed: its template with the row's (a
    :data:`~orbitkv_fs.segment.HEADER_DTYPE` record) payload CRC and stored length."""
    return msgspec.structs.replace(template, payload_crc=int(row["payload_crc"]),
                                   stored_length=int(row["stored_length"]))
