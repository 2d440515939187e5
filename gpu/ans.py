"""``ans`` for host arrays: nvCOMP ANS on the GPU behind :mod:`orbitkv_fs.codecs.ans`.

Primitives (used by :class:`orbitkv_fs.codecs.ans.AnsCodec`):

* :func:`encode_host_array` -- numpy array -> :class:`~orbitkv_fs.codecs.base.Encoded` (the payload:
  a chunk table and nvCOMP ANS bitstreams of 64 KiB chunks, :mod:`orbitkv_fs.gpu.ans_format`) or
  :class:`~orbitkv_fs.codecs.base.Declined`.
* :func:`decode_host_payload` -- header + payload -> flat numpy array of ``header.dtype``.

Policy (DESIGN.md): sources under 4 KiB or not a multiple of 8 bytes are declined (raw,
``UNSUPPORTED``); 16-bit floats are compressed with nvCOMP's FLOAT16 type, FP8 E4M3 with its FP8 type,
everything else as bytes; the keep-or-raw 12.5% rule of :func:`orbitkv_fs.codecs.encode_segment`
then stores incompressible data raw. Decoding checks nvCOMP's status and the exact decompressed
length and raises typed :class:`~orbitkv_fs.errors.SegmentError` s otherwise.

Invariant: these functions produce and accept the payload format of the batched engine
(:class:`orbitkv_fs.gpu.engine.GpuCodecEngine`); either decodes the other's segments. (The bitstream
bytes themselves may differ: nvCOMP picks its sub-chunk count from the batch.)
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

from . import ans_format
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


def encode_host_array(x: np.ndarray) -> Encoded | Declined:
    """Compress ``x`` (any dtype, C order) with nvCOMP ANS; decline what ANS does not take."""
    x = np.ascontiguousarray(x)
    n = x.nbytes
    if n < ANS_MIN_BYTES or n % 8:
        return Declined(RawReason.UNSUPPORTED, f"ans needs at least {ANS_MIN_BYTES} bytes in whole 8-byte words")
    if n > MAX_SOURCE_BYTES:
        return Declined(RawReason.TOO_LARGE, "ans segments hold at most 16 MiB")
    t = ans_type_of(x.dtype)
    cb = ans_format.CHUNK_BYTES
    nch = ans_format.chunk_count(n)
    cap = -(-_NV.max_compressed_bytes(cb, t) // 256) * 256
    temp = _NV.compress_temp_bytes(nch, cb, n, t)
    j = np.arange(nch, dtype=np.uint64)
    with _LOCK, _stream() as s:
        d_in = cp.asarray(x.reshape(-1).view(np.uint8))
        d_out = cp.empty(nch * cap, dtype=np.uint8)
        d_temp = cp.empty(max(temp, 1), dtype=np.uint8)
        arrays = cp.asarray(np.concatenate([d_in.data.ptr + cb * j, np.minimum(cb, n - cb * j.astype(np.int64)),
                                            d_out.data.ptr + cap * j]).astype(np.uint64))
        sizes = cp.zeros(nch, dtype=np.uint64)
        status = cp.full(nch, -1, dtype=np.int32)
        a = arrays.data.ptr
        _NV.compress(a, a + 8 * nch, cb, nch, d_temp.data.ptr, temp, a + 16 * nch, sizes.data.ptr, t,
                     status.data.ptr, s.ptr)
        st, got = status.get(), sizes.get()
        if np.any(st != 0) or np.any(got == 0) or np.any(got > cap):
            bad = int(st[np.flatnonzero(st)[0]]) if np.any(st != 0) else 0
            return Declined(RawReason.UNSUPPORTED, f"nvCOMP ANS compression failed ({_NV.status_name(bad)})")
        out = d_out.get()
        s.synchronize()
    payload = ans_format.pack([out[i * cap: i * cap + int(got[i])] for i in range(nch)])
    return Encoded(payload=np.frombuffer(payload, dtype=np.uint8), ans_type=int(t))


def decode_host_payload(header: SegmentHeader, payload: "memoryview | bytes") -> np.ndarray:
    """Decompress an ANS payload to a flat array of ``header.dtype`` (every chunk's length checked)."""
    n = header.original_length
    offsets, sizes = ans_format.parse(payload, n)
    nch = int(sizes.size)
    cb = ans_format.CHUNK_BYTES
    j = np.arange(nch, dtype=np.int64)
    want = np.minimum(cb, n - cb * j)
    temp = _NV.decompress_temp_bytes(nch, cb, n, header.ans_type)
    with _LOCK, _stream() as s:
        d_in = cp.asarray(np.frombuffer(payload, dtype=np.uint8))
        d_out = cp.empty(n, dtype=np.uint8)
        d_temp = cp.empty(max(temp, 1), dtype=np.uint8)
        arrays = cp.asarray(np.concatenate([d_in.data.ptr + offsets.astype(np.uint64), sizes, want,
                                            d_out.data.ptr + cb * j.astype(np.uint64)]).astype(np.uint64))
        actual = cp.zeros(nch, dtype=np.uint64)
        status = cp.full(nch, -1, dtype=np.int32)
        a = arrays.data.ptr
        _NV.decompress(a, a + 8 * nch, a + 16 * nch, actual.data.ptr, nch, d_temp.data.ptr, temp, a + 24 * nch,
                       header.ans_type, status.data.ptr, s.ptr)
        st, got = status.get(), actual.get()
        if np.any(st != 0):
            raise SegmentError(f"nvCOMP ANS decompression failed ({_NV.status_name(int(st[np.flatnonzero(st)[0]]))})")
        if not np.array_equal(got.astype(np.int64), want):
            raise LengthMismatch(f"ANS decompressed {int(got.sum())} bytes, header says {n}")
        out = d_out.get()
        s.synchronize()
    return out.view(header.dtype)
