"""The codec object protocol, in the manner of numcodecs.

A codec has a ``codec_id`` (its public name), parameters, ``encode``/``decode`` on payloads, and
``get_config``/``from_config``. Codecs here work on payloads only; :mod:`orbitkv_fs.codecs` wraps them
with the segment header and the keep-or-raw policy. ``encode`` returns ``None`` when the codec declines
the input (and says why), so that the caller stores it raw -- a codec never clips or guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..segment import RawReason, Role, SegmentHeader


@dataclass(frozen=True)
class Encoded:
    """A codec's answer for one source array: a payload and the header fields it implies."""

    payload: bytes | np.ndarray
    bits: int = 0
    head_dim: int = 0
    sign_version: int = 0
    rotation_seed: int = 0
    ans_type: int = 0


@dataclass(frozen=True)
class Declined:
    """The codec does not take this input; the segment is stored raw for ``reason``."""

    reason: RawReason
    detail: str = ""


class Codec:
    codec_id: ClassVar[str]
    exact: ClassVar[bool]

    def encode(self, x: np.ndarray, *, role: Role, layer: int) -> Encoded | Declined:
        raise NotImplementedError

    def decode(self, header: SegmentHeader, payload: memoryview) -> np.ndarray:
        """Decode ``payload`` to a flat array of ``header.dtype``."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        params = {k: v for k, v in config.items() if k != "id"}
        return cls(**params)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"
