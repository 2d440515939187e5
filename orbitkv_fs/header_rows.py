"""Segment header rows read as bytes by compiled code: the byte offset of each field of
:data:`~orbitkv_fs.segment.HEADER_DTYPE` that numba kernels read, and two helpers for them.

Primitives: :data:`FORMAT_AT`, :data:`ROLE_AT`, :data:`LAYER_AT`, :data:`DTYPE_AT`, :data:`ORIGINAL_AT`,
:data:`STORED_AT`, :data:`PAYLOAD_CRC_AT`, :data:`RAW_REASON_AT`, :data:`HEADER_CRC_AT` (field offsets);
:func:`u32_at` (a little-endian 32-bit field of a row, as int64); :func:`field_crc` (how a 32-bit field's value
changes a header's own CRC32C, by one of :func:`~orbitkv_fs.segment.header_crc_tables`).

Invariants: the offsets are ``HEADER_DTYPE``'s, so a row read here is the one ``pack_header`` writes. The
helpers compute in int64: numba promotes mixes of uint32 and int64 to float64. Needs numpy and numba only.
"""

from __future__ import annotations

import numba
import numpy as np

from .segment import HEADER_DTYPE

FORMAT_AT, ROLE_AT, LAYER_AT, DTYPE_AT, ORIGINAL_AT, STORED_AT, PAYLOAD_CRC_AT, RAW_REASON_AT, HEADER_CRC_AT = (
    HEADER_DTYPE.fields[f][1] for f in ("format", "role", "layer", "dtype", "original_length", "stored_length",
                                        "payload_crc", "raw_reason", "header_crc"))


@numba.njit(inline="always")
def u32_at(b: np.ndarray, at: int) -> int:
    """The little-endian 32-bit value at byte ``at`` of byte row ``b``."""
    return np.int64(b[at]) | np.int64(b[at + 1]) << 8 | np.int64(b[at + 2]) << 16 | np.int64(b[at + 3]) << 24


@numba.njit(inline="always")
def field_crc(t: np.ndarray, v: int) -> int:
    """What value ``v`` of a 32-bit field adds (XOR) to a header's CRC32C, by that field's ``(4, 256)`` table."""
    return np.int64(t[0, v & 0xFF] ^ t[1, (v >> 8) & 0xFF] ^ t[2, (v >> 16) & 0xFF] ^ t[3, (v >> 24) & 0xFF])
