"""The ANS payload: nvCOMP ANS bitstreams of 64 KiB chunks behind a chunk table (docs/format-ans.md).

Host-only (numpy), shared by the batched engine, :mod:`orbitkv_fs.gpu.ans` and the tests:

* :func:`chunk_count`, :func:`data_start` -- the layout arithmetic (also in ``kernels/ans.cu``).
* :func:`pack` -- compressed chunks -> payload bytes (what ``okv_ans_pack`` writes on the GPU).
* :func:`parse` -- payload -> (offsets, sizes) of the chunks, validated against the header's original
  length; every inconsistency is a typed :class:`~orbitkv_fs.errors.SegmentError`.
* :func:`parse_table` -- the same from the chunk table and the payload length alone (a payload in device
  memory: only its table comes to the host).
* :func:`parse_tables` -- :func:`parse_table` of a batch of payloads lying in one host array, one compiled
  pass (a restore batch's ANS segments as arrays): the chunks of all of them, and a typed error per payload
  that does not parse (:func:`table_error`).
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
from typing import NamedTuple

import numba
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


class Tables(NamedTuple):
    """:func:`parse_tables` 's answer: per payload its chunk count (from its original length), its first chunk in
    ``offsets`` / ``sizes`` (the chunks' offsets in their payload and compressed sizes, payload after payload)
    and an error code (0: parsed; else :func:`table_error` tells which) with the value it concerns."""

    nch: np.ndarray
    chunk0: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    err: np.ndarray
    value: np.ndarray


# parse_tables' error codes, in parse_table's order of checks
_NO_TABLE, _CHUNK_SIZE, _COUNT, _TRUNCATED, _ENDS, _ZERO, _OUTSIDE = 1, 2, 3, 4, 5, 6, 7


@numba.njit(cache=True, nogil=True)
def _u32(buf: np.ndarray, at: int) -> int:  # pragma: no cover - compiled
    return (np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8) | (np.int64(buf[at + 2]) << 16)
            | (np.int64(buf[at + 3]) << 24))


@numba.njit(cache=True, nogil=True)
def _parse_tables(buf: np.ndarray, off: np.ndarray, stored: np.ndarray, nch: np.ndarray, chunk0: np.ndarray,
                  offsets: np.ndarray, sizes: np.ndarray, err: np.ndarray, value: np.ndarray) -> None:  # pragma: no cover
    for i in range(len(off)):
        o, length = off[i], stored[i]
        if o < 0 or length < 0 or o + length > len(buf):
            err[i] = _OUTSIDE
            continue
        if length < 8:
            err[i] = _NO_TABLE
            continue
        chunk, n = _u32(buf, o), _u32(buf, o + 4)
        if chunk != CHUNK_BYTES:
            err[i], value[i] = _CHUNK_SIZE, chunk
            continue
        if n != nch[i] or n == 0:
            err[i], value[i] = _COUNT, n
            continue
        pos = (8 + 4 * n + 7) // 8 * 8
        if length < pos:
            err[i] = _TRUNCATED
            continue
        zero = False
        for j in range(n):
            z = _u32(buf, o + 8 + 4 * j)
            zero |= z == 0
            offsets[chunk0[i] + j] = pos
            sizes[chunk0[i] + j] = z
            pos += (z + 7) // 8 * 8
        if pos != length:
            err[i], value[i] = _ENDS, pos
        elif zero:
            err[i] = _ZERO


def parse_tables(buf: np.ndarray, off: np.ndarray, stored: np.ndarray, original: np.ndarray) -> Tables:
    """:func:`parse_table` of each payload ``buf[off[i]:off[i] + stored[i]]`` (``buf``: a uint8 array holding
    them all) whose segment decodes to ``original[i]`` bytes, in one compiled pass; a payload outside ``buf``
    is an error too, never read."""
    off, stored, original = (np.asarray(x, dtype=np.int64) for x in (off, stored, original))
    nch = -(-original // CHUNK_BYTES)
    chunk0 = np.cumsum(nch) - nch
    total = int(nch.sum())
    offsets, sizes = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
    err, value = np.zeros(len(off), dtype=np.int8), np.zeros(len(off), dtype=np.int64)
    _parse_tables(buf, off, stored, nch, chunk0, offsets, sizes, err, value)
    return Tables(nch, chunk0, offsets, sizes, err, value)


def table_error(t: Tables, i: int, stored: int, original: int) -> "UnknownFormat | LengthMismatch":
    """The error of payload ``i`` of :func:`parse_tables` (``t.err[i]`` nonzero), as :func:`parse_table` raises it."""
    code, v = int(t.err[i]), int(t.value[i])
    if code == _CHUNK_SIZE:
        return UnknownFormat(f"ans chunk size {v} (this build reads {CHUNK_BYTES})")
    return LengthMismatch({
        _NO_TABLE: f"ans payload of {stored} bytes has no chunk table",
        _COUNT: f"ans payload has {v} chunks; {original} bytes need {chunk_count(original)}",
        _TRUNCATED: "ans chunk table is truncated",
        _ENDS: f"ans chunks end at {v}, payload has {stored} bytes",
        _ZERO: "ans chunk of zero bytes",
    }.get(code, f"ans payload of {stored} bytes lies outside the memory given"))
