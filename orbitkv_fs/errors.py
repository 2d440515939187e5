"""Typed errors of OrbitKV-FS.

Every error the package raises on purpose derives from :class:`OrbitKVError`. Errors caused by bytes
(a segment, a record, a peer's answer) derive from :class:`SegmentError`; callers that serve cached data
turn a ``SegmentError`` into a miss, never into a crash or a wrong answer.
"""

from __future__ import annotations


class OrbitKVError(Exception):
    """Base of every error raised on purpose by OrbitKV-FS."""


class SegmentError(OrbitKVError):
    """An encoded segment failed validation. The bytes must not be served."""


class TruncatedSegment(SegmentError):
    """Fewer bytes than the header or its declared payload length need."""


class BadMagic(SegmentError):
    """The first bytes are not a segment header."""


class UnsupportedVersion(SegmentError):
    """The header version is not one this build reads."""


class HeaderChecksumMismatch(SegmentError):
    """The header's own CRC32C does not match its bytes."""


class PayloadChecksumMismatch(SegmentError):
    """The payload's CRC32C does not match the header."""


class UnknownFormat(SegmentError):
    """The format id, source dtype, role or a codec parameter is not one this build knows."""


class LengthMismatch(SegmentError):
    """The lengths in the header do not add up, or exceed the format's bounds."""


class CodecError(OrbitKVError):
    """A codec cannot be used as asked (unknown name, bad input, missing dependency)."""


class CodecUnavailable(CodecError):
    """The codec needs a dependency this machine lacks (e.g. ``ans`` without a GPU and nvCOMP)."""
