"""``none``: raw bytes. Exact; the payload is the source's bytes in C order."""

from __future__ import annotations

import numpy as np

from ..segment import SegmentHeader
from .base import Codec, Declined, Encoded


class NoneCodec(Codec):
    codec_id = "none"
    exact = True

    def encode(self, x: np.ndarray, *, role, layer) -> Encoded | Declined:  # noqa: ARG002
        return Encoded(payload=np.ascontiguousarray(x))

    def decode(self, header: SegmentHeader, payload: memoryview) -> np.ndarray:
        return np.frombuffer(payload, dtype=header.dtype).copy()
