"""Segment checks the Manager makes before it serves or admits bytes.

Primitives: :func:`_verify` (header, key's layer/role, payload CRC32C), :func:`_verify_header` (the same
without the payload CRC, for bytes a tier validated a moment ago), :func:`_verify_headers` (that of a
batch, as arrays, in compiled passes; :func:`_header_rows` gathers its headers, :func:`header_fields` reads
them as a structured array, :func:`header_of` makes a passed row's header), :func:`read_sizes` (the size
fields of a restore's arena extents against their destinations, their headers gathered, in one compiled pass),
:func:`_check_keys` (16-byte chunk keys), :data:`_HEADERS` (parsed-header templates), :data:`_REP_NAMES`
(Format value -> representation name).

Invariants: every check raises :class:`~orbitkv_fs.errors.SegmentError` (never returns a half-checked
header); a segment whose header names another layer or role than its key is refused. The batch checks give
:func:`_verify_header`'s verdict on every row (tests/test_restore_batch.py compares them); the compiled passes
check their bounds before they read.
"""

from __future__ import annotations

from typing import Sequence

import crc32c as _crc32c
import msgspec
import numba
import numpy as np

from ..errors import SegmentError, UnknownFormat
from ..header_rows import (
    DTYPE_AT,
    FORMAT_AT,
    HEADER_CRC_AT,
    LAYER_AT,
    ORIGINAL_AT,
    PAYLOAD_CRC_AT,
    ROLE_AT,
    STORED_AT,
    field_crc,
    u32_at,
)
from ..keys import key_layer_role
from ..segment import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_STORED_BYTES,
    Format,
    HeaderTemplates,
    Role,
    SegmentHeader,
    header_crc_tables,
    parse_header,
    parse_segment,
)
from .api import RequestError

_REP_NAMES = {int(f): f.name.lower() for f in Format}


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
#: Templates _verify_headers validated: fixed header bytes -> (header with payload CRC 0, CRC32C of its
#: first 60 bytes). Bounded: cleared when full (corrupt headers are never added).
_TEMPLATES: dict[bytes, tuple[SegmentHeader, int]] = {}
_TEMPLATES_KEPT = 4096
#: The same per batch: the distinct fixed bytes of a batch's headers, concatenated -> _templates_of's answer.
_BATCH_TEMPLATES: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, list[SegmentHeader]]] = {}
_BATCHES_KEPT = 256


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
        body = fixed[:PAYLOAD_CRC_AT] + bytes(4) + fixed[PAYLOAD_CRC_AT:]
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


#: _distinct_fixed's answers by the batch's header bytes but for their CRCs: a restore's batches of whole
#: chunks repeat one sequence of headers but for their CRCs (its layers, roles and lengths), and so do later
#: restores of that shape. Bounded: cleared when full.
_GROUPS: dict[bytes, tuple[np.ndarray, bytes]] = {}
_GROUPS_KEPT = 64

_ANS = int(Format.ANS)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _read_sizes(buf: np.ndarray, buf64: np.ndarray, at: np.ndarray, offs: np.ndarray, lens: np.ndarray, nseg: int,
                codes: np.ndarray, block_bytes: np.ndarray, nblocks: np.ndarray, heads: np.ndarray,
                heads64: np.ndarray, sizes: np.ndarray, fit: np.ndarray) -> int:
    for k in range(at.shape[0]):  # bounds first (boundscheck is off), so that a bad row reads nothing
        if not (0 <= offs[k] <= buf.shape[0] - HEADER_SIZE and 0 <= at[k] < heads.shape[0]):
            return k
    for k in range(at.shape[0]):
        r, o = at[k], offs[k]
        # By words where the header is aligned (arena extents are): a byte loop does not vectorise, and costs
        # 6x as much; a slice assignment copies through a temporary.
        if o % 8 == 0 and o // 8 + HEADER_SIZE // 8 <= buf64.shape[0]:
            for w in range(HEADER_SIZE // 8):
                heads64[r, w] = buf64[o // 8 + w]
        else:
            for b in range(HEADER_SIZE):
                heads[r, b] = buf[o + b]
        si, ci = r % nseg, r // nseg
        orig, stored = u32_at(heads[r], ORIGINAL_AT), u32_at(heads[r], STORED_AT)
        fit[r] = (heads[r, DTYPE_AT] == codes[si] and orig == nblocks[ci] * block_bytes[si]
                  and stored + HEADER_SIZE == lens[k])
        sizes[r, 0] = stored
        sizes[r, 1] = orig
        sizes[r, 2] = stored + HEADER_SIZE
        sizes[r, 3] = lens[k]
        sizes[r, 4] = o
    return -1


def read_sizes(buf: np.ndarray, at: np.ndarray, offs: np.ndarray, lens: np.ndarray, codes: np.ndarray,
               block_bytes: np.ndarray, nblocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The size fields of segments bound for destinations of ``nblocks[c]`` blocks of ``block_bytes[s]`` bytes
    holding dtype ``codes[s]`` (-1: none fits), read in one compiled pass from byte array ``buf`` (an arena):
    row ``at[k]`` (chunk-major, ``c * len(codes) + s``) is the extent of ``lens[k]`` bytes at ``offs[k]``. Answers
    per row whether its dtype, original length and stored length fit (False for a row not in ``at``), its header
    bytes ``[n, 64]`` (zeros: not read), and its batch bytes (its payload), decoded bytes, stored bytes, extent
    length and offset ``[n, 5]``. Unverified: the rest of each header is :func:`_verify_headers`' job. Raises
    IndexError, having read nothing, for a header outside ``buf``."""
    n = len(nblocks) * len(codes)
    sizes = np.zeros((n, 5), dtype=np.int64)
    heads = np.zeros((n, HEADER_SIZE), dtype=np.uint8)
    fit = np.zeros(n, dtype=bool)
    bad = _read_sizes(buf, buf[:len(buf) // 8 * 8].view(np.uint64), at, offs, lens, len(codes), codes, block_bytes,
                      nblocks, heads, heads.view(np.uint64), sizes, fit)
    if bad >= 0:
        raise IndexError(f"row {int(at[bad])}: a header at {int(offs[bad])} is not inside {len(buf)} bytes "
                         f"or the row not one of {n}")
    return fit, heads, sizes


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _fixed_rows(heads: np.ndarray, heads64: np.ndarray, fixed: np.ndarray, fixed64: np.ndarray,
                xor: np.ndarray) -> None:
    # What a template fixes: the CRC fields zeroed, an ANS payload's length (not 0) as 1 (xor: its own ^ 1). That
    # length stands for any other in its template: the one thing a header's fields say of it beyond the
    # template's is its bound (and that it is not empty, which a zero length keeps to its template).
    for i in range(heads.shape[0]):
        for w in range(HEADER_SIZE // 8):  # by words: the rows are the same bytes, seen as uint64
            fixed64[i, w] = heads64[i, w]
        for k in range(4):
            fixed[i, PAYLOAD_CRC_AT + k] = 0
            fixed[i, HEADER_CRC_AT + k] = 0
        s = u32_at(heads[i], STORED_AT)
        xor[i] = 0
        if heads[i, FORMAT_AT] == _ANS and s > 0:
            xor[i] = s ^ 1
            for k in range(1, 4):
                fixed[i, STORED_AT + k] = 0
            fixed[i, STORED_AT] = 1  # little-endian 1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _row_verdicts(heads: np.ndarray, inv: np.ndarray, valid: np.ndarray, bases: np.ndarray, tid_of: np.ndarray,
                  layers: np.ndarray, roles: np.ndarray, lengths: np.ndarray, xor: np.ndarray, t_pay: np.ndarray,
                  t_sto: np.ndarray, ok: np.ndarray, tid: np.ndarray) -> None:
    for i in range(heads.shape[0]):
        g, h = inv[i], heads[i]
        s = u32_at(h, STORED_AT)
        crc = np.int64(bases[g]) ^ field_crc(t_pay, u32_at(h, PAYLOAD_CRC_AT)) ^ field_crc(t_sto, np.int64(xor[i]))
        ok[i] = (valid[g] and u32_at(h, HEADER_CRC_AT) == crc
                 and (np.int64(h[LAYER_AT]) | np.int64(h[LAYER_AT + 1]) << 8) == layers[i]
                 and np.int64(h[ROLE_AT]) == roles[i] and lengths[i] == s + HEADER_SIZE
                 and not (h[FORMAT_AT] == _ANS and s > MAX_STORED_BYTES))
        tid[i] = tid_of[g]


def _distinct_fixed(fixed: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Headers' fixed bytes ``fixed`` (``[n, 64]`` uint8, their CRC fields zeroed: :func:`_fixed_rows`) grouped:
    each header's group, and the groups' fixed bytes (:data:`_FIXED` of each group's first row, one after
    another). Grouped on a 64-bit mix of the words; every header is then compared with
    its group's first, and a collision (never seen) regroups on the bytes themselves. A sequence of headers seen
    before is answered from :data:`_GROUPS`."""
    n = len(fixed)
    key = fixed.tobytes()
    got = _GROUPS.get(key)
    if got is not None:
        return got
    wide = fixed.view("<u8")
    mixed = np.bitwise_xor.reduce(wide * _MIX, axis=1)
    _, first, inv = np.unique(mixed, return_index=True, return_inverse=True)
    inv = inv.reshape(n)
    if not (wide == wide[first[inv]]).all():
        _, first, inv = np.unique(wide.view(f"V{HEADER_SIZE}").reshape(n), return_index=True, return_inverse=True)
        inv = inv.reshape(n)
    if len(_GROUPS) >= _GROUPS_KEPT:
        _GROUPS.clear()
    inv = inv.astype(np.int64)
    inv.flags.writeable = False  # shared by the batches that meet it
    got = _GROUPS[key] = (inv, fixed[first][:, _FIXED].tobytes())
    return got


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
    (:func:`_template`); each header's own CRC32C is checked from its template's, with the fields, in one
    compiled pass (:func:`_row_verdicts`, by :func:`~orbitkv_fs.segment.header_crcs`' tables). Answers ``ok``
    (rows that :func:`_verify_header` would pass), per row its template's index (-1 for an invalid one) and the
    templates (headers with payload CRC 0). The header of an ok row ``i`` is ``templates[tid[i]]`` with
    ``payload_crc`` and ``stored_length`` ``heads``' fields (:func:`header_of`); a row that is not ok fails
    :func:`_verify_header`, which says why."""
    n = len(heads)
    heads = np.ascontiguousarray(heads, dtype=np.uint8).reshape(n, HEADER_SIZE)
    fixed = np.empty_like(heads)
    xor = np.empty(n, dtype=np.uint32)
    _fixed_rows(heads, heads.view(np.uint64), fixed, fixed.view(np.uint64), xor)
    inv, distinct = _distinct_fixed(fixed)
    valid, bases, tid_of, templates = _templates_of(distinct)
    ok = np.empty(n, dtype=bool)
    tid = np.empty(n, dtype=np.int64)
    _row_verdicts(heads, inv, valid, bases, tid_of, np.asarray(layers, dtype=np.int64),
                  np.asarray(roles, dtype=np.int64), np.asarray(lengths, dtype=np.int64), xor, *_CRC_TABLES, ok, tid)
    return ok, tid, templates


#: The tables of header_crcs: how the payload-CRC and stored-length fields change a header's own CRC32C.
_CRC_TABLES = header_crc_tables()


def header_of(template: SegmentHeader, row: np.ndarray) -> SegmentHeader:
    """The header of a row that :func:`_verify_headers` passed: its template with the row's (a
    :data:`~orbitkv_fs.segment.HEADER_DTYPE` record) payload CRC and stored length."""
    return msgspec.structs.replace(template, payload_crc=int(row["payload_crc"]),
                                   stored_length=int(row["stored_length"]))
