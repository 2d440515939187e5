"""Host (CPU) codecs and the segment-level API every other part uses.

Primitives:

* :func:`encode_segment` -- array -> segment bytes (header + payload), applying the keep-or-raw policy.
* :func:`decode_segment` -- segment bytes -> flat array of the source dtype, after full validation.
* :func:`get_codec` -- a codec object by public name (``none``, ``ans``, ``fp8``, ``turboquant-4``,
  ``turboquant-3``), numcodecs style.

Policy (DESIGN.md): an encoding is kept only when its 512-byte-aligned footprint saves at least 12.5%;
sources over 16 MiB, FP8 out-of-range or nonfinite sources, unsupported dtypes or head dims stay raw, and
the header records why. Lossy codecs are opt-in by name; ``none`` and ``ans`` are exact.
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecError
from ..segment import (
    MAX_SOURCE_BYTES,
    MAX_STORED_BYTES,
    Format,
    RawReason,
    Role,
    SegmentHeader,
    build_segment,
    parse_segment,
    worth_keeping,
)
from .base import Codec, Declined, Encoded
from .fp8 import Fp8Codec
from .none import NoneCodec
from .turboquant import TurboQuantCodec

CODEC_NAMES = ("none", "ans", "fp8", "turboquant-4", "turboquant-3")
LOSSY_CODECS = frozenset({"fp8", "turboquant-4", "turboquant-3"})

_FORMATS = {"none": Format.RAW, "ans": Format.ANS, "fp8": Format.FP8, "turboquant-4": Format.TURBOQUANT,
            "turboquant-3": Format.TURBOQUANT}

__all__ = [
    "CODEC_NAMES",
    "LOSSY_CODECS",
    "Codec",
    "Declined",
    "Encoded",
    "decode_segment",
    "encode_segment",
    "format_of",
    "get_codec",
]


def get_codec(name: str, *, seed: int = 0) -> Codec:
    """The codec called ``name``. ``ans`` raises CodecUnavailable where the GPU stack is missing."""
    if name == "none":
        return NoneCodec()
    if name == "fp8":
        return Fp8Codec()
    if name in ("turboquant-4", "turboquant-3"):
        return TurboQuantCodec(int(name[-1]), seed)
    if name == "ans":
        from .ans import AnsCodec

        return AnsCodec()
    raise CodecError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}")


def format_of(name: str) -> Format:
    """The segment format a codec name produces when it does not fall back to raw."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}") from None


def raw_segment(x: np.ndarray, *, role: Role, layer: int, reason: RawReason) -> bytes:
    """A raw segment holding ``x``'s bytes (C order)."""
    x = np.ascontiguousarray(x)
    h = SegmentHeader(Format.RAW, x.dtype, x.nbytes, x.nbytes, 0, role=role, layer=layer, raw_reason=reason)
    return build_segment(h, x.reshape(-1).view(np.uint8))


def encode_segment(x: np.ndarray, codec: "str | Codec", *, role: "str | Role" = "opaque", layer: int = 0) -> bytes:
    """Encode ``x`` with ``codec`` into a segment (header + payload); raw where the policy says so."""
    x = np.asarray(x)
    try:
        role = Role.parse(role)
    except ValueError as e:
        raise CodecError(str(e)) from None
    if not 0 <= layer <= 0xFFFF:
        raise CodecError(f"layer {layer} outside 0..65535")
    if x.nbytes > MAX_STORED_BYTES:
        raise CodecError(f"segment of {x.nbytes} bytes exceeds the {MAX_STORED_BYTES}-byte segment bound")
    c = get_codec(codec) if isinstance(codec, str) else codec
    if c.codec_id == "none":
        return raw_segment(x, role=role, layer=layer, reason=RawReason.NONE)
    if x.nbytes > MAX_SOURCE_BYTES:
        return raw_segment(x, role=role, layer=layer, reason=RawReason.TOO_LARGE)
    res = c.encode(x, role=role, layer=layer)
    if isinstance(res, Declined):
        return raw_segment(x, role=role, layer=layer, reason=res.reason)
    payload = res.payload
    stored = payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
    if not worth_keeping(x.nbytes, stored):
        return raw_segment(x, role=role, layer=layer, reason=RawReason.NOT_SMALLER)
    h = SegmentHeader(
        format_of(c.codec_id),
        np.dtype(x.dtype),
        x.nbytes,
        stored,
        0,
        role=role,
        layer=layer,
        bits=res.bits,
        head_dim=res.head_dim,
        sign_version=res.sign_version,
        rotation_seed=res.rotation_seed,
        ans_type=res.ans_type,
    )
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return build_segment(h, payload)


def decode_payload(h: SegmentHeader, payload: memoryview) -> np.ndarray:
    """Decode an already validated payload to a flat array of ``h.dtype``."""
    if h.format == Format.RAW:
        return np.frombuffer(payload, dtype=h.dtype).copy()
    if h.format == Format.FP8:
        return Fp8Codec().decode(h, payload)
    if h.format == Format.TURBOQUANT:
        return TurboQuantCodec(h.bits, h.rotation_seed).decode(h, payload)
    return get_codec("ans").decode(h, payload)


def decode_segment(blob: "bytes | bytearray | memoryview") -> np.ndarray:
    """Validate ``blob`` (header, lengths, CRC32C) and decode it to a flat array of its source dtype."""
    h, payload = parse_segment(blob)
    return decode_payload(h, payload)
