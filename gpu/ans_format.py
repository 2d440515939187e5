"""The ANS payload: nvCOMP ANS bitstreams of 64 KiB chunks behind a chunk table (docs/format-ans.md).

Host-only (numpy), shared by the batched engine, :mod:`orbitkv_fs.gpu.ans` and the tests:

* :func:`chunk_count`, :func:`data_start` -- the layout arithmetic (also in ``kernels/ans.cu``).
* :func:`pack` -- compressed chunks -> payload bytes (what ``okv_ans_pack`` writes on the GPU).
* :func:`parse` -- payload -> (offsets, sizes) of the chunks, validated against the header's original
  length; every inconsistency is a typed :class:`~orbitkv_fs.errors.SegmentError`.
* :func:`parse_table` -- the same from the chunk table and the payload length alone (a payload in device
  memory: only its table comes to the host).
* :func:`keep_capacity` -- the largest payload the keep-or-raw rule would keep for a source length.

Layout (little-endian): ``u32 chunk_bytes`` (65536), ``u32 nchunks`` (ceil(original / 65536)),
``u32 sizes[nchunks]``, zeros up to a multiple of 8, then each chunk's bitstream padded with zeros to a
multiple of 8 bytes. So every chunk starts 8-byte aligned (nvCOMP's input alignment) and the payload
length is ``data_start + sum(align8(size))``. Why chunks: nvCOMP's ANS parallelises over chunks (and
at most 64 sub-chunks of each), so one 16 MiB chunk runs at a few GB/s where 64 KiB chunks run at
hundreds.
"""

from __future__ import annotations

import struct

import numpy as np

from orbitkv_fs.errors import LengthMismatch, UnknownFormat
from orbitkv_fs.segment import ALIGNMENT, HEADER_SIZE, MIN_SAVING_DEN, MIN_SAVING_NUM, aligned

CHUNK_BYTES = 65536
_TABLE_HEAD = struct.Struct("<II")  # chunk bytes, chunk count


def _al8(n: "int | np.ndarray") -> "int | np.ndarray":
    return (n + 7) // 8 * 8


def chunk_count(original_length: int) -> int:
    return -(-original_length // CHUNK_BYTES)


def data_start(nchunks: int) -> int:
    return int(_al8(8 + 4 * nchunks))


def keep_capacity(original_length: int) -> int:
    """Largest stored length that :func:`orbitkv_fs.segment.worth_keeping` accepts (may be < 0)."""
    raw = aligned(HEADER_SIZE + original_length)
    limit = raw * (MIN_SAVING_DEN - MIN_SAVING_NUM) // MIN_SAVING_DEN
    return limit // ALIGNMENT * ALIGNMENT - HEADER_SIZE


def pack(chunks: "list[bytes | np.ndarray]") -> bytes:
    """The payload holding ``chunks`` (each one nvCOMP ANS bitstream of up to 64 KiB of source)."""
    sizes = [len(c) if isinstance(c, (bytes, bytearray, memoryview)) else c.nbytes for c in chunks]
    head = np.zeros(data_start(len(chunks)), dtype=np.uint8)
    head[:8] = np.frombuffer(np.array([CHUNK_BYTES, len(chunks)], dtype="<u4").tobytes(), np.uint8)
    head[8:8 + 4 * len(chunks)] = np.frombuffer(np.array(sizes, dtype="<u4").tobytes(), np.uint8)
    parts = [head.tobytes()]
    for c, n in zip(chunks, sizes):
        parts.append(bytes(c))
        parts.append(bytes(int(_al8(n)) - n))
    return b"".join(parts)


def parse(payload: "bytes | memoryview", original_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of the chunks of ``payload``; raises UnknownFormat / LengthMismatch."""
    mv = memoryview(payload).cast("B")
    return parse_table(mv, len(mv), original_length)


def parse_table(head: "bytes | memoryview", payload_length: int, original_length: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`parse` from the payload's first bytes only (``head``: at least the chunk table) and its
    length: a payload in device memory needs only its table on the host."""
    mv = memoryview(head).cast("B")
    if payload_length < 8 or len(mv) < 8:
        raise LengthMismatch(f"ans payload of {payload_length} bytes has no chunk table")
    chunk, n = _TABLE_HEAD.unpack_from(mv)
    if chunk != CHUNK_BYTES:
        raise UnknownFormat(f"ans chunk size {chunk} (this build reads {CHUNK_BYTES})")
    if n != chunk_count(original_length) or n == 0:
        raise LengthMismatch(f"ans payload has {n} chunks; {original_length} bytes need {chunk_count(original_length)}")
    start = data_start(n)
    if payload_length < start or len(mv) < 8 + 4 * n:
        raise LengthMismatch("ans chunk table is truncated")
    sizes = np.frombuffer(mv, dtype="<u4", count=n, offset=8).astype(np.int64)
    # cumsum from the data start: the chunks' ends; one pass each (a restore parses every ANS segment's table)
    padded = (sizes + 7) & ~7
    ends = padded.cumsum()
    ends += start
    if int(ends[-1]) != payload_length:
        raise LengthMismatch(f"ans chunks end at {int(ends[-1])}, payload has {payload_length} bytes")
    if not sizes.all():
        raise LengthMismatch("ans chunk of zero bytes")
    return ends - padded, sizes
