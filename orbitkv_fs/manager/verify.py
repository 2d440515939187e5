"""Segment checks the Manager makes before it serves or admits bytes.

Primitives: :func:`_verify` (header, key's layer/role, payload CRC32C), :func:`_verify_header` (the same
without the payload CRC, for bytes a tier validated a moment ago), :func:`_check_keys` (16-byte chunk keys),
:data:`_HEADERS` (parsed-header templates), :data:`_REP_NAMES` (Format value -> representation name).

Invariants: every check raises :class:`~orbitkv_fs.errors.SegmentError` (never returns a half-checked
header); a segment whose header names another layer or role than its key is refused.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import SegmentError, UnknownFormat
from ..keys import key_layer_role
from ..segment import HEADER_SIZE, Format, HeaderTemplates, Role, SegmentHeader, parse_segment
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
