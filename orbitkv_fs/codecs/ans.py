"""``ans``: lossless nvCOMP ANS. GPU only: the host side only names the missing dependency.

The encoder and decoder live in :mod:`orbitkv_fs.gpu.ans`; this module loads them lazily so that the
core stays importable without cupy. On a machine without cupy, a GPU or libnvcomp.so.5, asking for ``ans``
raises :class:`~orbitkv_fs.errors.CodecUnavailable` naming what is missing.
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecUnavailable
from ..segment import SegmentHeader
from .base import Codec, Declined, Encoded


def _gpu_ans():
    try:
        from orbitkv_fs.gpu import ans as gpu_ans  # noqa: PLC0415 - optional dependency
    except Exception as e:  # ImportError, or CUDA failing to initialise
        raise CodecUnavailable(
            "codec 'ans' needs a CUDA GPU, cupy and nvCOMP 5.3 (pip install 'orbitkv-fs[gpu]'): "
            f"{type(e).__name__}: {e}"
        ) from e
    return gpu_ans


class AnsCodec(Codec):
    codec_id = "ans"
    exact = True

    def __init__(self) -> None:
        self._impl = _gpu_ans()

    def encode(self, x: np.ndarray, *, role, layer) -> Encoded | Declined:
        return self._impl.encode_host_array(x)

    def decode(self, header: SegmentHeader, payload: memoryview) -> np.ndarray:
        return self._impl.decode_host_payload(header, payload)
