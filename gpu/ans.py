"""``ans`` for host arrays: nvCOMP ANS on the GPU behind :mod:`orbitkv_fs.codecs.ans`.

Primitives (used by :class:`orbitkv_fs.codecs.ans.AnsCodec`):

* :func:`encode_host_array` -- numpy array -> :class:`~orbitkv_fs.codecs.base.Encoded` (the payload is
  one nvCOMP batched-ANS chunk, see ``docs/format-ans.md``) or :class:`~orbitkv_fs.codecs.base.Declined`.
* :func:`decode_host_payload` -- header + payload -> flat numpy array of ``header.dtype``.

Policy (DESIGN.md): sources under 4 KiB or not a multiple of 8 bytes are declined (raw,
``UNSUPPORTED``); 16-bit floats are compressed with nvCOMP's FLOAT16 type, FP8 E4M3 with its FP8 type,
everything else as bytes; the keep-or-raw 12.5% rule of :func:`orbitkv_fs.codecs.encode_segment`
then stores incompressible data raw. Decoding checks nvCOMP's status and the exact decompressed
length and raises typed :class:`~orbitkv_fs.errors.SegmentError` s otherwise.

Invariant: these functions produce and accept the same payload bytes as the batched engine
(:class:`orbitkv_fs.gpu.engine.GpuCodecEngine`), which calls nvCOMP the same way.
Importing this module loads nvCOMP and fails with :class:`~orbitkv_fs.errors.CodecUnavailable` when
the library is missing or not the supported ABI.
"""

from __future__ import annotations

import threading

import cupy as cp
import numpy as np

from orbitkv_fs.codecs.base import Declined, Encoded
from orbitkv_fs.errors import LengthMismatch, SegmentError
from orbitkv_fs.segment import MAX_SOURCE_BYTES, RawReason, SegmentHeader

from . import nvcomp as _nv
from .engine import ANS_MIN_BYTES, ans_type_of

_NV = _nv.load()  # start-up check: a clear CodecUnavailable here rather than at the first segment
_LOCK = threading.Lock()
_STREAM: "cp.cuda.Stream | None" = None


def _stream() -> cp.cuda.Stream:
    global _STREAM
    if _STREAM is None:
        _STREAM = cp.cuda.Stream(non_blocking=True)
    return _STREAM


def _ptrs(*values: int) -> cp.ndarray:
    return cp.asarray(np.array(values, dtype=np.uint64))


def encode_host_array(x: np.ndarray) -> Encoded | Declined:
    """Compress ``x`` (any dtype, C order) with nvCOMP ANS; decline what ANS does not take."""
    x = np.ascontiguousarray(x)
    n = x.nbytes
    if n < ANS_MIN_BYTES or n % 8:
        return Declined(RawReason.UNSUPPORTED, f"ans needs at least {ANS_MIN_BYTES} bytes in whole 8-byte words")
    if n > MAX_SOURCE_BYTES:
        return Declined(RawReason.TOO_LARGE, "ans chunks are at most 16 MiB")
    t = ans_type_of(x.dtype)
    cap = _NV.max_compressed_bytes(n, t)
    temp = _NV.compress_temp_bytes(1, n, n, t)
    with _LOCK, _stream() as s:
        d_in = cp.asarray(x.reshape(-1).view(np.uint8))
        d_out = cp.empty(cap, dtype=np.uint8)
        d_temp = cp.empty(max(temp, 1), dtype=np.uint8)
        arrays = _ptrs(d_in.data.ptr, n, d_out.data.ptr)
        size = cp.zeros(1, dtype=np.uint64)
        status = cp.full(1, -1, dtype=np.int32)
        _NV.compress(arrays.data.ptr, arrays.data.ptr + 8, n, 1, d_temp.data.ptr, temp, arrays.data.ptr + 16,
                     size.data.ptr, t, status.data.ptr, s.ptr)
        st, got = int(status.get()[0]), int(size.get()[0])
        if st != 0 or not 0 < got <= cap:
            return Declined(RawReason.UNSUPPORTED, f"nvCOMP ANS compression failed ({_NV.status_name(st)})")
        payload = d_out[:got].get()
        s.synchronize()
    return Encoded(payload=payload, ans_type=int(t))


def decode_host_payload(header: SegmentHeader, payload: "memoryview | bytes") -> np.ndarray:
    """Decompress an ANS payload to a flat array of ``header.dtype`` (length checked exactly)."""
    n = header.original_length
    src = np.frombuffer(payload, dtype=np.uint8)
    if src.size == 0:
        raise LengthMismatch("ans segment with an empty payload")
    temp = _NV.decompress_temp_bytes(1, max(n, 1), max(n, 1), header.ans_type)
    with _LOCK, _stream() as s:
        d_in = cp.asarray(src)
        d_out = cp.empty(max(n, 1), dtype=np.uint8)
        d_temp = cp.empty(max(temp, 1), dtype=np.uint8)
        arrays = _ptrs(d_in.data.ptr, src.size, n, d_out.data.ptr)
        actual = cp.zeros(1, dtype=np.uint64)
        status = cp.full(1, -1, dtype=np.int32)
        _NV.decompress(arrays.data.ptr, arrays.data.ptr + 8, arrays.data.ptr + 16, actual.data.ptr, 1,
                       d_temp.data.ptr, temp, arrays.data.ptr + 24, header.ans_type, status.data.ptr, s.ptr)
        st, got = int(status.get()[0]), int(actual.get()[0])
        if st != 0:
            raise SegmentError(f"nvCOMP ANS decompression failed ({_NV.status_name(st)})")
        if got != n:
            raise LengthMismatch(f"ANS decompressed {got} bytes, header says {n}")
        out = d_out[:n].get()
        s.synchronize()
    return out.view(header.dtype)
