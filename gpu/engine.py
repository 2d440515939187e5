"""The GPU codec engine: batched segment encode/decode on a budgeted, retained workspace.

Owns the batch pipeline between engine KV on the GPU and complete segments in pinned host memory:

* :class:`GpuCodecEngine` -- two :class:`Worker` s (save = encode, restore = decode), each with its own
  CUDA streams, workspace and two pinned staging buffers, so saves and restores never wait on each other.
* Two streams per worker: kernels run on ``stream``, the bulk host copies of a batch (an encode's
  device-to-host download, a decode's upload) on ``copies``, joined by events. One batch's kernels
  then run while the other batch's bytes cross PCIe, instead of after them.
* Two batches in flight per worker: :meth:`GpuCodecEngine.encode_submit` / ``decode_submit`` queue a
  batch (into the part of the workspace the batch in flight leaves free, from the other staging buffer)
  and return; a batch takes at most half of the workspace (a segment that needs more runs alone), so
  that the next one fits beside it instead of waiting for it. ``encode_collect`` / ``decode_collect``
  wait for a batch and run its host part (headers, verdicts). ``encode_batch`` / ``decode_batch`` are
  submit then collect. A caller that submits its next batch before collecting the previous one overlaps
  its host work with the GPU's and the copies.
* Batches as arrays: :meth:`GpuCodecEngine.encode_columns_submit` (a class index and a source address per
  segment, the classes from :meth:`GpuCodecEngine.encode_class`) and ``decode_columns_submit`` (verified
  header rows, pinned payload addresses, destination addresses) take a batch with no Python object per
  segment: its slots, headers and verdicts are numpy passes over columns (``_EncCols``, ``_DecCols``), its
  descriptor rows one numba call per kernel group (:mod:`orbitkv_fs.gpu.rows`, the item path's writers too),
  and what depends on the classes alone (their columns, slot sizes, header templates) is kept per class
  sequence (``_ClassSet``): a save's batches pass the same one again; so are, per class vector, a batch's cut
  into flights and each flight's plan (``_FlightPlan``: offsets, slots, columns, kernel groups, signs, ANS
  rounds and chunk arrays but for their sources), which a save of whole chunks repeats batch after batch
  (``PLANS_KEPT`` of them); on decode, by the
  headers but for their CRCs, a batch's flights and each flight's plan without ANS (``_DecPlan``: offsets,
  kernel groups, descriptor rows but for their addresses and expected CRCs). ANS too: its chunk
  arrays from the class columns on encode; on decode its chunk tables parsed from the caller's pinned array in one pass
  (:func:`~orbitkv_fs.gpu.ans_format.parse_tables`). They answer None for what they do not take
  (host-decided encodes, a segment over half the workspace, ANS payloads outside a given array):
  ``encode_submit`` / ``decode_submit`` then do.
* ANS payloads packed: ``okv_ans_place`` lays a batch's ANS slots one after another once nvCOMP has sized
  them, so the download (cut at the previous batch's packed share, the rest fetched when short) and the
  arena hold the packed bytes, not each slot's worst case.
* Page blocks: :meth:`GpuCodecEngine.gather_blocks` / ``scatter_blocks`` move every block of a batch
  between an engine's pages and a contiguous buffer in one ``okv_copy_blocks`` launch (a table of
  ``orbitkv_fs.pages.BLOCK_COPY_DTYPE`` rows, read by the kernel from a pinned buffer of its own). Sources and
  destinations may be :class:`DeviceSpan` s (address, length, shape) instead of cupy arrays.
* :class:`Workspace` -- one device allocation per worker, bounded by the budget
  (``--storage-codec-budget``, default 64 MB), retained and reused across batches; growth drains the
  worker's streams and frees the old allocation before allocating the new one; :meth:`Workspace.release`
  drains them before freeing.
* Descriptor batches of at most :data:`MAX_BATCH` (1024) segments. One encode batch is: one
  host-to-device copy (descriptors, ANS chunk arrays, zeroed meta), one launch per kernel kind present
  (FP8 encode with fused CRC32C; TurboQuant encode of K and of V; ANS in rounds (:class:`_AnsRounds`), each
  nvCOMP's compression of its 64 KiB chunks, one call per nvCOMP data type, into one set of worst-case chunk
  buffers that every round of the batch reuses, then ``okv_ans_place`` and ``okv_ans_pack``, which moves the
  round into its slots and computes the ANS payloads' CRC32C; CRC32C -- with the copy for raw segments -- over
  raw and TurboQuant payloads), one
  device-to-host copy of [meta | ANS payload lengths | segment slots] on the copy stream -- statuses,
  raw CRCs, sizes and payloads together -- and one wait for the event after it. A column flight has its
  headers written on the GPU before that download (``okv_write_headers``: the CRC32Cs finished there, each
  header in front of its payload; an ANS one at the slot and with the length ``okv_ans_pack`` left), so the
  host reads only the statuses, ANS lengths and admitted fields; an item flight's host finishes the CRC32Cs
  (:func:`orbitkv_fs.gpu.tables.finish_crc`) and writes each header in front of its payload, in place.
* Direct SSD I/O (cuFile): ``encode_batch(device_sink=...)`` hands each GPU-encoded segment's device bytes
  (headers copied up into their slots) to the caller before the workspace is reused; ``decode_batch``
  takes segments in device memory (cupy uint8 arrays) besides host bytes: only their header (and an ANS
  chunk table) comes to the host, the payload is CRC-checked and decoded where it lies.
* Decode: one host-to-device copy on the copy stream (descriptors + payloads; pinned payloads from where they
  lie, neighbours in one copy), CRC32C of every payload on the GPU, the
  decode kernels (which skip any segment whose CRC differs from its header: its destination is not
  touched), nvCOMP for ANS chunks into workspace scratch followed by a checked copy (every chunk's status
  and exact length) -- or, for a caller whose destinations are its own scratch (``decode_columns_submit(...,
  in_place=True)``: the Manager's restore temporary), straight into the destinations, with the same checks
  on the host -- and one device-to-host copy of the meta. Failures are reported per segment, never raised.

Invariants:

* GPU output bytes equal :func:`orbitkv_fs.codecs.encode_segment` 's for the same input, codec, role,
  layer and TurboQuant seed, including the raw fallbacks and their reasons; decoded values equal
  :func:`orbitkv_fs.codecs.decode_segment` 's. ANS is the exception to byte equality: the same format
  decisions and decoded bytes, but nvCOMP's bitstreams depend on the batch (docs/format-ans.md).
* A segment whose workspace needs exceed the budget alone is encoded/decoded by the host codec
  (CPU fallback, counted in ``stats["cpu_fallbacks"]``); ANS, which has no CPU codec, is then
  stored raw (reason ``UNSUPPORTED``) on encode and decoded by :mod:`orbitkv_fs.gpu.ans` (outside
  the arena) on restore.
* Sources must be C-contiguous cupy arrays or DeviceSpans, untouched until their encode is collected; the
  worker stream waits for the caller's current stream before reading them. Destinations are complete when
  :meth:`GpuCodecEngine.decode_batch` (or ``decode_collect``) returns; block scatters when the event
  ``scatter_blocks`` returns has completed.
"""

from __future__ import annotations

import functools
import threading
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import cupy as cp
import msgspec
import numpy as np

from orbitkv_fs.codecs import CODEC_NAMES, decode_payload, encode_segment, get_codec, raw_segment
from orbitkv_fs.codecs.fp8 import BF16, FP16
from orbitkv_fs.errors import CodecError, LengthMismatch, OrbitKVError, PayloadChecksumMismatch, SegmentError
from orbitkv_fs.errors import TruncatedSegment
from orbitkv_fs.hostmem import host_address
from orbitkv_fs.segment import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_SOURCE_BYTES,
    MAX_STORED_BYTES,
    TURBOQUANT_HEAD_DIMS,
    AnsType,
    Format,
    RawReason,
    Role,
    SegmentHeader,
    dtype_code,
    dtype_from_code,
    fixed_words,
    header_row,
    parse_header,
    turboquant_stored_bytes,
    worth_keeping,
)

from . import ans_format
from . import module as km
from . import rows as rows_
from .headers import ANS_ROW, write_headers
from .placement import pair_bytes, place_beside
from .tables import finish_crc, sign_words, zero_crc

MAX_BATCH = 1024
ANS_MARGIN = 0.04  # an encode batch downloads its ANS slots up to the previous batch's packed share plus this
# An encode batch compresses its ANS segments in rounds that reuse one set of nvCOMP chunk output buffers (a 64
# KiB chunk's worst case is 89,288 bytes): at most this share of the half workspace a batch may take, unless one
# segment needs more. Buffers for the whole batch made an ANS segment take 2.2x its size of workspace (its slot
# and its chunks' buffers), so that ANS batches held half the segments of raw ones.
ANS_ROUND_SHARE = 4
DEFAULT_BUDGET_BYTES = 64 << 20
SLOT_ALIGN = 256  # slot starts; the payload (slot + 64) is then 64-byte aligned, as the CRC units need
ANS_MIN_BYTES = 4096
# Staging of pinned payloads mirrors their host layout across gaps up to this (a segment header and the
# arena's allocation-unit padding), so that neighbours go up in one copy.
_MIRROR_GAP = 1024
_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind


def _up(n: int, a: int = SLOT_ALIGN) -> int:
    return -(-n // a) * a


def ans_type_of(dtype: np.dtype) -> AnsType:
    """nvCOMP data type for a source dtype: 16-bit floats, FP8 E4M3, or a byte stream."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype in (BF16, FP16):
        return AnsType.FLOAT16
    if dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return AnsType.FP8
    return AnsType.BYTES


class DeviceSpan(NamedTuple):
    """A C-contiguous device region by address: an encode source or decode destination given without a
    cupy array (a slice of a batch buffer costs a few microseconds per array operation)."""

    ptr: int
    nbytes: int
    shape: tuple = ()  # the array shape it stands for (TurboQuant reads the head dim from shape[-1])


def _span(a: Any) -> "DeviceSpan | None":
    """``a`` as a DeviceSpan: itself, or a C-contiguous cupy array's; None for anything else."""
    if isinstance(a, DeviceSpan):
        return a
    if isinstance(a, cp.ndarray) and a.flags.c_contiguous:
        return DeviceSpan(int(a.data.ptr), int(a.nbytes), tuple(a.shape))
    return None


def _dec_target(i: int, dst: Any, h: SegmentHeader) -> "DeviceSpan | OrbitKVError":
    """Decode destination ``i`` as a DeviceSpan of exactly the segment's original length, or why not."""
    span = _span(dst)
    if span is None:
        return CodecError(f"destination {i} must be a C-contiguous cupy array or a DeviceSpan")
    if span.nbytes != h.original_length:
        return LengthMismatch(f"destination {i} holds {span.nbytes} bytes; the segment decodes to {h.original_length}")
    return span


_DEC_KINDS = {Format.RAW: "raw", Format.FP8: "fp8", Format.TURBOQUANT: "tq", Format.ANS: "ans"}
_GPU_FORMATS = np.zeros(256, dtype=bool)  # by a header's format byte: one the GPU decodes (a lookup, not np.isin)
_GPU_FORMATS[list(_DEC_KINDS)] = True
_FP16_CODE = dtype_code(FP16)


class EncodeItem(msgspec.Struct, frozen=True):
    """One source region to encode into one segment.

    ``array`` is a C-contiguous cupy array (a view of engine KV) or a :class:`DeviceSpan`; its last axis
    is the head dim for TurboQuant. ``dtype`` names the source dtype when the array's own is a stand-in
    (cupy has no bfloat16: pass a uint16 view and ``dtype=ml_dtypes.bfloat16``); a DeviceSpan needs it.
    """

    array: Any
    codec: str
    role: "Role | str" = Role.OPAQUE
    layer: int = 0
    dtype: Any = None
    #: The header's raw reason when ``codec`` is ``none`` (the Manager's policy-exact layers: POLICY).
    raw_reason: RawReason = RawReason.NONE


class _Enc(msgspec.Struct, eq=False):
    i: int
    item: EncodeItem
    ptr: int
    n: int
    dtype: np.dtype
    role: Role
    layer: int
    kind: str  # raw | fp8 | tq | ans | host
    reason: RawReason = RawReason.NONE
    shape: tuple = ()
    head_dim: int = 0
    bits: int = 0
    ans_type: AnsType = AnsType.NONE
    cap: int = 0  # payload capacity of the slot
    slot: int = 0  # offset of the slot (header) in the output region
    meta: int = 0
    nch: int = 0  # ANS: 64 KiB chunks
    chunk0: int = 0  # ANS: index of the first chunk in the batch's chunk arrays
    tmp: int = 0  # ANS: workspace offset of the chunks' nvCOMP output buffers
    #: The header fields as ints (format, dtype code, original, stored, role, layer, bits, head dim, sign
    #: version, seed, ANS type, raw reason) when the GPU encodes it as planned; ANS: all but the stored
    #: length, known once nvCOMP has run.
    head: tuple = ()


class _Dec(msgspec.Struct, eq=False):
    i: int
    h: SegmentHeader
    payload: memoryview
    dst: Any
    kind: str  # raw | fp8 | tq | ans | host
    staged: int = 0  # offset of the payload in the upload region
    scratch: int = 0  # ANS: offset of the decompressed bytes in the workspace
    meta: int = 0
    ans_index: int = 0
    chunk0: int = 0  # ANS: first chunk in the batch's chunk arrays
    offsets: Any = None  # ANS: chunk offsets and sizes in the payload (ans_format.parse)
    sizes: Any = None
    dev: int = 0  # device address of the payload when the segment was handed in device memory
    inplace: bool = False  # ... and the kernels read it where it is (else it is copied to ``staged``)


@dataclass
class EncodeJob:
    """An :meth:`GpuCodecEngine.encode_submit` in progress: its segments (filled as batches finish), and the
    header fields of each GPU-encoded one as arrays, so that a caller admits a batch without parsing a
    header per segment: ``fmt`` (the Format, -1 for a host-encoded or raw-fallback segment, whose header
    the caller reads from its bytes), ``original`` (source bytes), ``length`` (header and payload bytes),
    ``reason`` (RawReason) and ``addr`` (host address of the segment's first byte)."""

    out: list
    flights: list = field(default_factory=list)
    fmt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    original: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reason: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    addr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def of(cls, k: int) -> "EncodeJob":
        return cls([None] * k, fmt=np.full(k, -1, np.int16), original=np.zeros(k, np.int64),
                   length=np.zeros(k, np.int64), reason=np.zeros(k, np.uint8), addr=np.zeros(k, np.int64))


@dataclass
class DecodeJob:
    """A :meth:`GpuCodecEngine.decode_submit` in progress: its per-segment errors (filled as batches finish)."""

    results: list
    flights: list = field(default_factory=list)


class WorkspaceTooSmall(CodecError):
    """A batch needs more device memory than the worker's budget allows."""


class Workspace:
    """One retained device allocation of at most ``budget`` bytes, used by one worker's streams;
    ``drain`` waits for everything queued on them."""

    def __init__(self, budget: int, drain: Callable[[], None]) -> None:
        self.budget = budget
        self.drain = drain
        self.ptr = 0
        self.size = 0
        self.grows = 0

    def reserve(self, nbytes: int) -> int:
        """Device address of at least ``nbytes``; grows (free first, then allocate) within the budget."""
        if nbytes > self.budget:
            raise WorkspaceTooSmall(f"batch needs {nbytes} bytes of workspace, budget is {self.budget}")
        if nbytes > self.size:
            new = min(self.budget, max(_up(nbytes, 1 << 20), 2 * self.size))
            self.release()
            self.ptr = cp.cuda.runtime.malloc(new)
            self.size = new
            self.grows += 1
        return self.ptr

    def release(self) -> None:
        """Drain the streams, then free the allocation."""
        if self.ptr:
            self.drain()
            cp.cuda.runtime.free(self.ptr)
            self.ptr = 0
            self.size = 0


class _Pinned:
    """A growable pinned host buffer reused across batches (each batch synchronises before reuse)."""

    def __init__(self) -> None:
        self.arr: "np.ndarray | None" = None
        self._mem = None

    def get(self, n: int) -> np.ndarray:
        if self.arr is None or self.arr.size < n:
            size = max(_up(n, 1 << 20), 2 * (0 if self.arr is None else self.arr.size))
            self._mem = cp.cuda.alloc_pinned_memory(size)
            self.arr = np.frombuffer(self._mem, np.uint8, size)
        return self.arr[:n]


def _pinned_array(n: int) -> np.ndarray:
    """A fresh pinned host array (from cupy's pinned pool) that the caller may keep."""
    mem = cp.cuda.alloc_pinned_memory(max(n, 1))
    return np.frombuffer(mem, np.uint8, n)


class _Layout:
    def __init__(self) -> None:
        self.end = 0

    def take(self, n: int, align: int = SLOT_ALIGN) -> int:
        off = _up(self.end, align)
        self.end = off + n
        return off


class _Fill(NamedTuple):
    """Running totals of a batch being filled, so that each segment's fit check is O(1) rather than a
    re-sum of the batch so far: segments, bytes (slots on encode, staging on decode), and the ANS
    segments' chunks, source (encode) or decoded (decode) bytes, nvCOMP data types and the most chunks of
    one segment."""

    k: int = 0
    bytes: int = 0
    ans: int = 0
    chunks: int = 0
    ans_bytes: int = 0
    types: frozenset = frozenset()
    widest: int = 0

    @classmethod
    def of(cls, nbytes: int, chunks: int = 0, ans_bytes: int = 0, ans_type: "AnsType | None" = None) -> "_Fill":
        """The totals of one segment (an ANS one when ``ans_type`` is given)."""
        if ans_type is None:
            return cls(1, nbytes)
        return cls(1, nbytes, 1, chunks, ans_bytes, frozenset((AnsType(ans_type),)), chunks)

    def plus(self, nbytes: int) -> "_Fill":
        """These totals and one more non-ANS segment of ``nbytes`` (``add(_Fill.of(nbytes))`` with one tuple,
        not three: the fit check runs once per segment)."""
        return _Fill(self.k + 1, self.bytes + nbytes, self.ans, self.chunks, self.ans_bytes, self.types, self.widest)

    def add(self, other: "_Fill") -> "_Fill":
        return _Fill(self.k + other.k, self.bytes + other.bytes, self.ans + other.ans, self.chunks + other.chunks,
                     self.ans_bytes + other.ans_bytes, self.types | other.types if other.types else self.types,
                     max(self.widest, other.widest))


@dataclass(eq=False)
class _Flight:
    """A batch launched on a worker's stream and not yet finished: its workspace extent, the upload
    buffer it was staged in, the event after its last copy, and the host work that completes it."""

    start: int
    end: int
    upload: int
    event: Any
    finish: Callable[[], None]


class Worker:
    """Two streams (kernels; bulk host copies) and two for side work (fetches of short downloads; a restore's
    block scatters), a workspace, two pinned upload buffers and counters. Up to
    two batches are in flight: the next one is launched (into the other part of the workspace, from the
    other upload buffer) before the host finishes the previous one, so that the host's work overlaps the
    GPU's, and one batch's kernels overlap the other's copies.

    Small copies (an encode's descriptors, a decode's statuses) stay on ``stream``, in order with the
    kernels; :meth:`handoff` orders one stream after the other where a batch's bytes change hands.

    Two, not three: three batches of a third of the workspace each saved 9-16% slower at 4 MiB segments
    (docs/results/2026-11-30-pipeline-gpu-11)."""

    def __init__(self, name: str, budget: int) -> None:
        self.name = name
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.copies = cp.cuda.Stream(non_blocking=True)
        # fetch's: a batch's host part runs once the next batch is queued on both streams, and a copy it
        # waits for there would wait for that batch too
        self.fetches = cp.cuda.Stream(non_blocking=True)
        # a restore's block scatters: each batch's is queued once its decode was collected, and on ``stream``
        # it would wait behind the next batch's decode, queued already and waiting for that batch's copy
        # (every scatter but the last ran after the next batch's copy; the one before the last, after the last
        # copy of the request)
        self.scatters = cp.cuda.Stream(non_blocking=True)
        # Orders one stream after another (handoff, wait_for_current): recorded, then waited on at once.
        # A wait takes the event's latest record when it is queued, so one event serves every ordering
        # (callers hold the lock) instead of a new CUDA event per batch.
        self._order = cp.cuda.Event(disable_timing=True)
        self.ws = Workspace(budget, self.sync)
        self.uploads = (_Pinned(), _Pinned())
        self.inflight: list[_Flight] = []  # oldest first
        # Events of finished flights, recorded again by the next ones: a flight's event is only waited on by
        # its own finish, so once that has returned it is free (no CUDA event made and destroyed per flight).
        self._spare_events: list = []
        # Block-copy tables: buffers of their own (not shared with a batch in flight), used in turn, each
        # with the event after the launch that reads it.
        self.tables = [_Pinned() for _ in range(3)]
        self.tables_read: list = [None] * len(self.tables)
        self.tables_next = 0
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()

    def h2d(self, dst: int, src: np.ndarray, stream: "cp.cuda.Stream | None" = None) -> None:
        self.h2d_raw(dst, src.ctypes.data, src.nbytes, stream)

    def h2d_raw(self, dst: int, src: int, nbytes: int, stream: "cp.cuda.Stream | None" = None) -> None:
        """Copy ``nbytes`` from host address ``src`` (pinned memory that outlives the copy) to ``dst``, on
        ``stream`` (default: the kernel stream)."""
        if nbytes:
            cp.cuda.runtime.memcpyAsync(dst, src, nbytes, _H2D, (stream or self.stream).ptr)
            self.stats["h2d_copies"] += 1

    def d2h(self, dst: np.ndarray, src: int, stream: "cp.cuda.Stream | None" = None) -> None:
        if dst.nbytes:
            cp.cuda.runtime.memcpyAsync(dst.ctypes.data, src, dst.nbytes, _D2H, (stream or self.stream).ptr)
            self.stats["d2h_copies"] += 1

    def fetch(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` of completed device work at ``src`` to host address ``dst`` now: on a stream of
        its own, so that the wait is for this copy alone, not for the batches queued since."""
        t0 = time.perf_counter_ns()
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, _D2H, self.fetches.ptr)
        self.fetches.synchronize()
        self.stats["wait_ns"] += time.perf_counter_ns() - t0
        self.stats["d2h_copies"] += 1

    def handoff(self, after: cp.cuda.Stream, before: cp.cuda.Stream) -> None:
        """Make work queued next on ``after`` wait for everything queued so far on ``before``."""
        self._order.record(before)
        after.wait_event(self._order)

    def sync(self) -> None:
        """Drain both streams."""
        t0 = time.perf_counter_ns()
        self.copies.synchronize()
        self.stream.synchronize()
        self.stats["wait_ns"] += time.perf_counter_ns() - t0
        self.stats["syncs"] += 1

    def wait_for_current(self) -> None:
        """Make this worker's stream wait for work already queued on the caller's current stream."""
        self.handoff(self.stream, cp.cuda.get_current_stream())

    def launch(self, k: km.Kernels, name: str, segs: int, nsegs: int, total: int, meta: int, table=None) -> None:
        self.stats["launches"] += km.launch(k, name, segs, nsegs, total, meta, self.stream, table)

    def write_headers(self, k: km.Kernels, rows: int, n: int, region: int, templates: int, bases: int) -> None:
        self.stats["launches"] += km.launch_write_headers(k, rows, n, region, templates, bases, self.stream)

    # -- batches in flight (the caller holds the lock) -----------------------------------------------
    def place(self, nbytes: int) -> "tuple[int, _Pinned]":
        """Workspace address and pinned upload buffer (``_Pinned``) for a new batch of ``nbytes``: beside the
        batch still in flight when both fit in the workspace, else after finishing it (the workspace may
        then grow, which needs nothing in flight).

        Double-ended (:func:`~orbitkv_fs.gpu.placement.place_beside`): below the batch in flight, else at the
        top of the workspace, so that any two consecutive batches that fit in it together run side by side
        (packed one after the other, a batch found no room beside a batch in the middle)."""
        while len(self.inflight) > 1:
            self.finish(self.inflight[0])
        if self.inflight:
            f = self.inflight[0]
            at = place_beside(self.ws.size, f.start, f.end, nbytes)
            if at is not None:
                return self.ws.ptr + at, self.uploads[1 - f.upload]
            self.finish(f)
            pair = pair_bytes(f.start, f.end, nbytes)
            if pair <= self.ws.budget:  # grow now so that the next pair fits side by side
                return self.ws.reserve(pair), self.uploads[0]
        return self.ws.reserve(nbytes), self.uploads[0]

    def drop(self, flights: "Sequence[_Flight]") -> None:
        """Drain the stream and forget these batches without their host part (a failed submit: nothing
        of it, queued or half-queued, may still write into buffers the caller is about to give back)."""
        self.sync()
        for f in flights:
            if f in self.inflight:
                self.inflight.remove(f)
                self._spare_events.append(f.event)

    def launched(self, base: int, nbytes: int, upload: "_Pinned", finish: Callable[[], None],
                 last: "cp.cuda.Stream | None" = None) -> _Flight:
        """Record a batch just queued (at ``base``, staged in ``upload``) as in flight, its end marked on
        ``last`` (default: the kernel stream), the stream that runs its final operation; returns it."""
        ev = self._spare_events.pop() if self._spare_events else cp.cuda.Event(disable_timing=True)
        ev.record(last or self.stream)
        start = base - self.ws.ptr
        f = _Flight(start, start + nbytes, self.uploads.index(upload), ev, finish)
        self.inflight.append(f)
        return f

    def finish(self, f: _Flight) -> None:
        """Wait for a batch in flight and run its host part (idempotent)."""
        if f not in self.inflight:
            return
        t0 = time.perf_counter_ns()
        f.event.synchronize()
        self.stats["wait_ns"] += time.perf_counter_ns() - t0
        self.stats["syncs"] += 1
        self.inflight.remove(f)
        self._spare_events.append(f.event)
        f.finish()

    def finish_all(self) -> None:
        while self.inflight:
            self.finish(self.inflight[0])

    def copy_blocks(self, k: km.Kernels, table: np.ndarray, stream: "cp.cuda.Stream | None" = None) -> Any:
        """Queue one ``okv_copy_blocks`` over ``table`` (BLOCK_COPY_DTYPE rows) on ``stream`` (default: the
        kernel stream); returns the event after it.

        The kernel reads the table where it lies, in pinned host memory (device-addressable under unified
        addressing): an upload on this stream would queue on the copy engine behind the other stream's
        bulk copies, and hold up the kernels after it. The pinned buffer is refilled only once the launch
        that read it (three tables ago) has run."""
        j = self.tables_next
        self.tables_next = (j + 1) % len(self.tables)
        if self.tables_read[j] is not None:
            t0 = time.perf_counter_ns()
            self.tables_read[j].synchronize()
            self.stats["wait_ns"] += time.perf_counter_ns() - t0
        host = self.tables[j].get(table.nbytes)
        host[:] = table.view(np.uint8)
        on = stream or self.stream
        self.stats["launches"] += km.launch_copy_blocks(k, host.ctypes.data, len(table), on)
        self.stats["block_copies"] += len(table)
        done = cp.cuda.Event(disable_timing=True)
        done.record(on)
        self.tables_read[j] = done
        return done

    def close(self) -> None:
        with self.lock:
            self.finish_all()
            self.ws.release()


def _dec_staging(p: _Dec) -> int:
    """Staging bytes a decode batch counts for ``p`` 's payload: its slot and the mirror gap."""
    return _up(p.h.stored_length) + _MIRROR_GAP


def _within(counts: np.ndarray) -> np.ndarray:
    """For consecutive runs of ``counts`` items: each item's index within its run (0, 1, .., 0, 1, ..)."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _ints(plist: Sequence[Any], attr: str) -> np.ndarray:
    """``getattr(p, attr)`` of each plan as an int64 array."""
    return np.fromiter(map(attrgetter(attr), plist), dtype=np.int64, count=len(plist))


def _fp16(dtypes: "Iterable[Any]", k: int) -> np.ndarray:
    """1 where a plan's source dtype is FP16 (the kernels' ``dtype`` field), else 0. Builtin and ml_dtypes
    dtypes are singletons: identity answers the usual cases without numpy's dtype comparison."""
    return np.fromiter([d is FP16 or (d is not BF16 and d == FP16) for d in dtypes], dtype=np.uint32, count=k)


# rows.py writes SEG_DTYPE's fields as columns of its (rows, 16) uint64 and (rows, 32) uint32 views
assert [km.SEG_DTYPE.fields[f][1] // 8 for f in ("src", "dst", "n", "n_dev", "st_dev")] == [
    rows_.Q_SRC, rows_.Q_DST, rows_.Q_N, rows_.Q_N_DEV, rows_.Q_ST_DEV]
assert [km.SEG_DTYPE.fields[f][1] // 4 for f in ("block0", "nblocks", "meta", "dtype", "head_dim", "bits", "role",
                                                 "expect_crc", "signs")] == [
    rows_.W_BLOCK0, rows_.W_NBLOCKS, rows_.W_META, rows_.W_DTYPE, rows_.W_HEAD_DIM, rows_.W_BITS, rows_.W_ROLE,
    rows_.W_EXPECT, rows_.W_SIGNS]


def _row_views(total: int) -> tuple[np.ndarray, np.ndarray]:
    q = np.zeros((total, km.SEG_DTYPE.itemsize // 8), dtype=np.uint64)
    return q, q.view(np.uint32)


def _put_rows(buf: np.ndarray, at: int, q: np.ndarray) -> None:
    """Write descriptor rows (their uint64 view, zero padding included) into ``buf`` at byte ``at``."""
    if q.size:
        buf[at:at + q.nbytes] = q.reshape(-1).view(np.uint8)


class _EncCols(NamedTuple):
    """An encode batch's segments as columns: row j is the batch's j-th segment (its ``meta`` index)."""

    kind: np.ndarray  # _KIND codes
    ptr: np.ndarray  # source device address
    slot: np.ndarray  # offset of the segment's slot (header) in the output region
    n: np.ndarray  # source bytes
    cap: np.ndarray  # payload capacity of the slot (coded segments)
    fp16: np.ndarray  # 1 where the source dtype is FP16 (the kernels' ``dtype`` field)
    head_dim: np.ndarray
    bits: np.ndarray
    role: np.ndarray
    layer: np.ndarray
    nch: np.ndarray  # ANS: 64 KiB chunks
    chunk0: np.ndarray  # ANS: index of the first chunk in the batch's chunk arrays
    tmp: np.ndarray  # ANS: workspace offset of the chunks' nvCOMP output buffers


_KIND = {"raw": 0, "fp8": 1, "tq": 2, "ans": 3, "host": 4}


class _ClassSet(NamedTuple):
    """What :meth:`GpuCodecEngine.encode_columns_submit` derives from its classes alone, kept per class
    sequence (a save's batches pass the same one again): the classes (held, so that their identities stay
    theirs), their columns, slot sizes (header and payload), stored payload bytes, and header templates."""

    classes: tuple
    table: _EncCols
    size: np.ndarray
    stored: np.ndarray
    templates: np.ndarray  # (classes, 64) uint8: each class's header with a zero payload CRC
    bases: np.ndarray  # their 60-byte CRC32Cs
    ans_type: np.ndarray  # ANS: nvCOMP's data type (the AnsType)


class _FlightPlan(NamedTuple):
    """What an encode flight takes from its class vector alone (:func:`_flight_plan`): its kinds, workspace
    offsets and size, the slots of its output region, its columns (``ptr`` left zero: the flight's sources),
    kernel groups with their TurboQuant signs, stored payload bytes (ANS: their capacity; nvCOMP decides) and
    upload bytes; for ANS segments their rows in packing order (by nvCOMP type), chunk counts, rounds, chunk
    buffer size and nvCOMP temp, and their chunk arrays but for the sources: each chunk's offset in its
    segment, its bytes and its output buffer's workspace offset (``chunk_fixed``). A save of whole chunks
    hands the engine the same class vector batch after batch: it is planned once (``GpuCodecEngine._plans``;
    its arrays read-only, shared by the flights that use it)."""

    kind: np.ndarray
    off: dict
    slots: np.ndarray
    total: int
    cols: "_EncCols"
    groups: tuple
    signs: dict
    walked: np.ndarray
    upload: int
    ans: np.ndarray
    nch: np.ndarray
    rounds: "_AnsRounds | None"
    chunk_cap: int
    temp: int
    chunk_at: np.ndarray  # each chunk's byte offset within its segment
    chunk_fixed: np.ndarray  # (2, chunks): each chunk's source bytes and its output buffer's workspace offset


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _remember(memo: dict, key: object, value: object) -> object:
    """``memo[key] = value`` (the memo cleared first when it holds PLANS_KEPT), answering ``value``."""
    if len(memo) >= PLANS_KEPT:
        memo.clear()
    memo[key] = value
    return value


#: Flight cuts and flight plans an engine keeps (``GpuCodecEngine._plans``), at most: a plan holds about 14 numbers
#: per segment of its flight (60-80 KB for a 512-segment flight), so an engine keeps a few MB of them, however
#: many class vectors its saves bring.
PLANS_KEPT = 64


def _flight_plan(cs: _ClassSet, c: np.ndarray, kind: np.ndarray, align: int, seed: int,
                 eng: "GpuCodecEngine | None" = None) -> _FlightPlan:
    """The :class:`_FlightPlan` of a flight of classes ``c`` (indices into ``cs``) at ``align``. ANS segments
    (``eng``: the engine whose nvCOMP sizes their chunk buffers and temp) as :meth:`GpuCodecEngine._run_encode`
    lays them out: by type, their slots last (packed on the GPU), their chunks and buffers in that order."""
    k, table = len(c), cs.table
    n_desc = int(np.count_nonzero(kind != _KIND["raw"]) + np.count_nonzero(kind != _KIND["fp8"]))
    a = np.flatnonzero(kind == _KIND["ans"])
    chunk, rounds, temp, chunk_cap = 0, None, 0, 0
    tmp, chunk0 = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    if len(a):
        assert eng is not None
        a = a[np.argsort(cs.ans_type[c[a]], kind="stable")]
        order = np.concatenate([np.flatnonzero(kind != _KIND["ans"]), a])
        nch = table.nch[c[a]]
        chunk = int(nch.sum())
        types = cs.ans_type[c[a]]
        rounds = _ans_rounds(nch, types, eng._round_chunks(int(nch.max())))
        temp = eng._round_temp(rounds.chunks, np.unique(types).tolist())
        chunk_cap = eng._chunk_cap()
        lay, off, slot_o = _enc_offsets(k, n_desc, chunk, len(a), cs.size[c[order]], align)
        slots = np.empty(k, dtype=np.int64)
        slots[order] = slot_o
        off["ans_slot0"] = int(slots[a[0]])
        tmp[a] = lay.take(rounds.chunks * chunk_cap) + chunk_cap * rounds.at
        chunk0[a] = rounds.chunk0
    else:
        nch = np.zeros(0, dtype=np.int64)
        lay, off, slots = _enc_offsets(k, n_desc, 0, 0, cs.size[c], align)
        off["ans_slot0"] = off["region_end"] - off["meta"]
    off["temp"] = lay.take(temp)
    off["align"] = align
    zeros = np.zeros(k, dtype=np.int64)
    cols = _EncCols(*(_frozen(x) for x in (kind, zeros, slots, table.n[c], table.cap[c], table.fp16[c],
                                             table.head_dim[c], table.bits[c], table.role[c], table.layer[c],
                                             table.nch[c], chunk0, tmp)))
    groups = tuple((name, _frozen(sel)) for name, sel in _enc_groups(cols, a))
    signs = {name: _sign_rows(cols.head_dim[sel], cols.layer[sel], np.full(len(sel), seed, dtype=np.int64))
             for name, sel in groups if len(sel) and _ENC_GROUPS[name] == rows_.ENC_TQ}
    cb = ans_format.CHUNK_BYTES
    at = _within(nch)
    chunk_fixed = np.empty((2, chunk), dtype=np.int64)
    chunk_fixed[0] = np.minimum(cb, np.repeat(cols.n[a], nch) - cb * at)
    chunk_fixed[1] = np.repeat(tmp[a], nch) + chunk_cap * at
    return _FlightPlan(cols.kind, off, cols.slot, lay.end, cols, groups, signs, _frozen(cs.stored[c]),
                       off["pay_len"] + 8 * (len(a) + 1), _frozen(a), _frozen(nch), rounds, chunk_cap, temp,
                       _frozen(cb * at), _frozen(chunk_fixed))


class _DecPlan(NamedTuple):
    """What a decode flight without ANS segments takes from its headers but for their CRCs (each segment's
    format, lengths, dtype, codec parameters, layer and role): its workspace offsets (its payloads staged from
    ``down_end`` on), its kernel groups, its descriptor rows with the payload and destination addresses and the
    expected CRCs left to fill in (the rows' segments in ``W_META``; rows ``0 .. check - 1`` are the CRC32C pass,
    which has no destination), the stored bytes and their zero-byte CRC parts. A restore of whole chunks hands
    the engine the same headers batch after batch: planned once (``GpuCodecEngine._dec_plans``; read-only)."""

    off: dict
    firsts: dict
    rows: np.ndarray  # [rows, 16] uint64
    check: int
    stored: np.ndarray
    zero: np.ndarray


def _header_rows(c: np.ndarray, plan: _FlightPlan) -> np.ndarray:
    """``okv_write_headers``' rows (:data:`~.module.HEADER_ROW_DTYPE`) of a flight of ``plan``, classes ``c``:
    segment ``i``'s header at its slot, its template its class's, its Meta row ``i``, its payload's walked
    bytes its class's stored length; an ANS segment's row (:data:`~.headers.ANS_ROW`) names the region offset of
    its payload length instead (its slot and length are the GPU's, ``okv_ans_pack``)."""
    k = len(c)
    rows = np.empty(k, dtype=km.HEADER_ROW_DTYPE)
    rows["slot"], rows["tid"], rows["meta"], rows["walked"] = plan.slots, c, np.arange(k), plan.walked
    if len(plan.ans):
        rows["slot"][plan.ans] = plan.off["pay_len"] - plan.off["meta"] + 8 * np.arange(len(plan.ans))
        rows["walked"][plan.ans] = ANS_ROW
    return rows


def _enc_cols(plans: "Sequence[_Enc]") -> _EncCols:
    """The columns of encode plans."""
    k = len(plans)
    return _EncCols(np.fromiter((_KIND[p.kind] for p in plans), dtype=np.int64, count=k), _ints(plans, "ptr"),
                    _ints(plans, "slot"), _ints(plans, "n"), _ints(plans, "cap"),
                    _fp16(map(attrgetter("dtype"), plans), k), _ints(plans, "head_dim"), _ints(plans, "bits"),
                    _ints(plans, "role"), _ints(plans, "layer"), _ints(plans, "nch"), _ints(plans, "chunk0"),
                    _ints(plans, "tmp"))


def _enc_groups(c: _EncCols, ans: "np.ndarray | None" = None) -> tuple[tuple[str, np.ndarray], ...]:
    """An encode batch's kernels in launch order with their rows: FP8, TurboQuant K and V, ANS packing (in
    the order ``ans`` gives, default the batch's), CRC32C (raw copies and TurboQuant outputs)."""
    tq = c.kind == _KIND["tq"]
    key = c.role == int(Role.KEY)
    if ans is None:
        ans = np.flatnonzero(c.kind == _KIND["ans"])
    return (("okv_fp8_encode", np.flatnonzero(c.kind == _KIND["fp8"])), ("okv_tq_encode_k", np.flatnonzero(tq & key)),
            ("okv_tq_encode_v", np.flatnonzero(tq & ~key)), ("okv_ans_pack", ans),
            ("okv_crc32c", np.flatnonzero(tq | (c.kind == _KIND["raw"]))))


def _encode_rows(buf: np.ndarray, at: int, c: _EncCols, groups: Sequence[tuple[str, np.ndarray]], payload0: int,
                 seed: int, chunk_cap: int, base: int, off: dict[str, int],
                 rounds: "_AnsRounds | None" = None,
                 signs: "dict[str, np.ndarray] | None" = None) -> dict[str, tuple[int, int]]:
    """An encode batch's descriptor rows (SEG_DTYPE), written into ``buf`` from offset ``at``, kernel by kernel
    in the order of ``groups`` (kernel name, the rows of ``c`` it takes). A segment's payload goes to
    ``payload0 + slot`` (the output region's slots); TurboQuant rows carry the signs of ``seed``; ANS packing
    rows (the j-th of its group: its payload length lands in pay_len[j]) the nvCOMP chunk outputs
    (``chunk_cap`` bytes each) and the chunk sizes, statuses and payload lengths at ``base + off[...]``, their
    work units counted within their round of ``rounds`` (each round is a launch of its own); ``signs``: the
    TurboQuant groups' sign rows, where the caller has them (:class:`_FlightPlan`).
    Answers, per kernel with segments, (first row, work units). One :func:`~orbitkv_fs.gpu.rows.encode_group`
    call per kernel over the whole batch, not a row at a time."""
    q, w = _row_views(sum(len(sel) for _, sel in groups))
    rows: dict[str, tuple[int, int]] = {}
    raw = c.kind == _KIND["raw"]
    r0 = 0
    for name, sel in groups:
        k = len(sel)
        if not k:
            continue
        code = _ENC_GROUPS[name]
        if code != rows_.ENC_TQ:
            group_signs = _NO_SIGNS
        elif signs is not None:
            group_signs = signs[name]
        else:
            group_signs = _sign_rows(c.head_dim[sel], c.layer[sel], np.full(k, seed, dtype=np.int64))
        units = rows_.encode_group(q, w, r0, code, sel, raw, c.ptr, c.slot, c.n, c.cap, c.fp16, c.head_dim, c.bits,
                                   c.role, c.nch, c.chunk0, c.tmp, group_signs, payload0, chunk_cap, base,
                                   base + off["pay_len"], base + off["chunk_sizes"], base + off["chunk_status"],
                                   km.CHUNK, km.TQ_VECTORS_PER_UNIT)
        if code == rows_.ENC_ANS and rounds is not None:
            w[r0:r0 + k, rows_.W_BLOCK0] = rounds.at
        rows[name] = (r0, units)
        r0 += k
    _put_rows(buf, at, q)
    return rows


_ENC_GROUPS = {"okv_fp8_encode": rows_.ENC_FP8, "okv_tq_encode_k": rows_.ENC_TQ, "okv_tq_encode_v": rows_.ENC_TQ,
               "okv_ans_pack": rows_.ENC_ANS, "okv_crc32c": rows_.ENC_CHECK}
_NO_SIGNS = np.zeros((0, 8), dtype=np.uint32)


def _write_headers(job: "EncodeJob", host: np.ndarray, templates: np.ndarray, bases: np.ndarray, tid: np.ndarray,
                   pcrc: np.ndarray, slots: np.ndarray, idx: np.ndarray, *, views: bool,
                   stored: "np.ndarray | None" = None) -> np.ndarray:
    """Write the headers of a batch's GPU-encoded segments into their ``slots`` of ``host`` (the batch's output
    region) and their fields into ``job`` at ``idx``: each segment's template row (``templates[tid]``, headers
    with a zero payload CRC, from ``_template_ids``) with its payload CRC ``pcrc`` and its header CRC from the
    template's ``bases`` (:func:`~.headers.write_headers`, one numba call); ``pcrc`` None: the GPU wrote them
    (``okv_write_headers``), only the fields are filled. ``stored``, when given: each segment's stored length, in
    place of its template's (ANS: what nvCOMP made of it). ``views``: ``job.out``
    also gets each segment's view of ``host``. Answers each segment's length (header and payload)."""
    write_headers(host, templates, bases, tid, pcrc, slots, idx,
                  (job.fmt, job.original, job.length, job.reason, job.addr), stored)
    length = job.length[idx]
    if views:
        mv = memoryview(host)
        for i, a, n in zip(idx.tolist(), slots.tolist(), length.tolist()):
            job.out[i] = mv[a:a + n]
    return length


def _enc_offsets(k: int, n_desc: int, chunks: int, nans: int, sizes: np.ndarray,
                 align: int) -> "tuple[_Layout, dict[str, int], np.ndarray]":
    """An encode batch's workspace up to its ANS buffers: descriptors, ANS chunk arrays, then the output
    region (meta, ANS payload lengths, the slots of ``sizes`` bytes one after another, each at the next
    multiple of ``align``), chunk sizes and statuses. Answers the layout, the offsets and each slot's offset
    in the region (from ``meta``)."""
    lay = _Layout()
    off = {"desc": lay.take(max(n_desc, 1) * km.SEG_DTYPE.itemsize), "chunk_in": lay.take(24 * max(chunks, 1))}
    off["meta"] = lay.take(16 * k, align)
    off["pay_len"] = lay.take(8 * (nans + 1), 8)  # and the rounds' carry (okv_ans_place) after the lengths
    # From an aligned start, a slot's start is the previous one's plus its size rounded up.
    first = _up(lay.end, align)
    steps = -(-sizes // align) * align
    starts = first + np.cumsum(steps) - steps
    if k:
        lay.end = int(starts[-1] + sizes[-1])
    off["region_end"] = lay.end
    off["chunk_sizes"] = lay.take(8 * max(chunks, 1))
    off["chunk_status"] = lay.take(4 * max(chunks, 1))
    return lay, off, starts - off["meta"]


@functools.cache  # one rule per alignment: _prefix_batches keeps its table
def _enc_fixed(align: int) -> Callable[[np.ndarray], np.ndarray]:
    """The part of a batch's encode estimate (no ANS, ``_enc_estimate``) that depends on its segment count."""
    def fixed(m: np.ndarray) -> np.ndarray:
        return (-(-(4 * m * km.SEG_DTYPE.itemsize) // SLOT_ALIGN) * SLOT_ALIGN
                + -(-(16 * m) // SLOT_ALIGN) * SLOT_ALIGN + _up(8) + 4 * 256 + align - SLOT_ALIGN)
    return fixed


class _DecCols(NamedTuple):
    """A decode batch's segments as columns: row j is the batch's j-th segment (its ``meta`` index)."""

    fmt: np.ndarray  # Format
    src: np.ndarray  # device address the kernels read the payload from
    dst: np.ndarray  # device address of the destination
    stored: np.ndarray
    orig: np.ndarray
    fp16: np.ndarray  # 1 where the source dtype is FP16 (the kernels' ``dtype`` field)
    head_dim: np.ndarray
    bits: np.ndarray
    role: np.ndarray
    layer: np.ndarray
    seed: np.ndarray
    expect: np.ndarray  # raw CRC (Meta.acc): the header's CRC32C without its zero-byte part
    scratch: np.ndarray  # ANS: device address of the decompressed bytes
    chunk0: np.ndarray  # ANS: first chunk in the batch's chunk arrays


def _header_cols(h: np.ndarray, src: np.ndarray, dst: np.ndarray) -> _DecCols:
    """The columns of segments whose headers are ``h`` (HEADER_DTYPE rows), none of them ANS."""
    stored = h["stored_length"].astype(np.int64)
    zeros = np.zeros(len(h), dtype=np.int64)
    return _DecCols(h["format"].astype(np.int64), src, dst, stored, h["original_length"].astype(np.int64),
                    (h["dtype"] == _FP16_CODE).astype(np.uint32), h["head_dim"].astype(np.int64),
                    h["bits"].astype(np.int64), h["role"].astype(np.int64), h["layer"].astype(np.int64),
                    h["rotation_seed"].astype(np.int64), _raw_crcs(h["payload_crc"], stored), zeros, zeros)


def _plan_cols(plans: "list[_Dec]", src: np.ndarray, base: int) -> _DecCols:
    """The columns of decode plans (``src``: where the kernels read each payload; ``base``: the workspace)."""
    k = len(plans)
    heads = list(map(attrgetter("h"), plans))

    def col(name: str) -> np.ndarray:
        return np.fromiter(map(attrgetter(name), heads), dtype=np.int64, count=k)

    stored = col("stored_length")
    ans = np.fromiter([p.kind == "ans" for p in plans], dtype=bool, count=k)
    return _DecCols(col("format"), src, np.fromiter([p.dst.ptr for p in plans], dtype=np.int64, count=k), stored,
                    col("original_length"), _fp16(map(attrgetter("dtype"), heads), k), col("head_dim"), col("bits"),
                    col("role"), col("layer"), col("rotation_seed"), _raw_crcs(col("payload_crc"), stored),
                    np.where(ans, base + _ints(plans, "scratch"), 0), np.where(ans, _ints(plans, "chunk0"), 0))


def _raw_crcs(crc: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """What the kernels' CRC accumulators end at for payloads whose CRC32C is ``crc``: the standard CRC
    without its zero-byte part (:func:`~orbitkv_fs.gpu.tables.zero_crc`)."""
    return (np.asarray(crc, dtype=np.int64) ^ zero_crc(stored).astype(np.int64)).astype(np.int64)


def _crc_verdicts(meta: np.ndarray, expect: np.ndarray, rows: np.ndarray, results: list) -> np.ndarray:
    """A finished decode flight's payload CRC verdicts: ``results[rows[j]]`` a PayloadChecksumMismatch where its
    accumulator in ``meta`` (the downloaded meta rows) is not ``expect[j]``; answers where they were not."""
    bad = meta[:16 * len(rows)].view(km.META_DTYPE)["acc"] != expect
    for j in np.flatnonzero(bad).tolist():
        i = int(rows[j])
        results[i] = PayloadChecksumMismatch(f"segment {i}: payload CRC32C mismatch")
    return bad


_SIGN_ROWS: dict[bytes, np.ndarray] = {}  # a batch's (seed, layer, head dim) keys -> its sign rows


def _sign_rows(head_dim: np.ndarray, layer: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """:func:`sign_words` of each row as ``[n, 8]`` uint32 (read-only), computed once per distinct (head dim,
    layer, seed). The batches of a save or restore repeat one sequence of (layer, role) segments: the rows of
    a sequence seen before are answered from a memo, without sorting its keys again."""
    key = (np.asarray(seed, dtype=np.uint64) << np.uint64(32)) | (np.asarray(layer, dtype=np.uint64) << np.uint64(16)) \
        | np.asarray(head_dim, dtype=np.uint64)
    memo = key.tobytes()
    rows = _SIGN_ROWS.get(memo)
    if rows is None:
        uniq, inv = np.unique(key, return_inverse=True)
        words = np.array([sign_words(u & 0xFFFF, (u >> 16) & 0xFFFF, u >> 32) for u in uniq.tolist()],
                         dtype=np.uint32)
        rows = words.reshape(len(uniq), 8)[inv.reshape(-1)]
        rows.flags.writeable = False
        if len(_SIGN_ROWS) >= 64:
            _SIGN_ROWS.clear()
        _SIGN_ROWS[memo] = rows
    return rows


def _decode_rows(buf: np.ndarray, at: int, c: _DecCols, actual: int, status: int,
                 ans_copied: bool = True) -> dict[str, tuple[int, int, int]]:
    """A decode batch's descriptor rows (SEG_DTYPE), written into ``buf`` from offset ``at``: the CRC32C
    check of every payload, then the FP8, TurboQuant and checked-copy (raw, and ANS unless ``ans_copied`` is
    False: nvCOMP wrote those in place) rows, each in batch order. ``actual`` / ``status``: device addresses of
    the ANS chunks' decoded sizes and statuses. Answers, per kernel, (first row, rows, work units). One
    :func:`~orbitkv_fs.gpu.rows.decode_group` call per kernel."""
    k = len(c.fmt)
    copied = (c.fmt == Format.RAW) | (c.fmt == Format.ANS) if ans_copied else c.fmt == Format.RAW
    groups = (("okv_crc32c", rows_.DEC_CHECK, np.arange(k)),
              ("okv_fp8_decode", rows_.DEC_FP8, np.flatnonzero(c.fmt == Format.FP8)),
              ("okv_tq_decode", rows_.DEC_TQ, np.flatnonzero(c.fmt == Format.TURBOQUANT)),
              ("okv_copy_checked", rows_.DEC_COPY, np.flatnonzero(copied)))
    q, w = _row_views(sum(len(sel) for _, _, sel in groups))
    ans = c.fmt == Format.ANS
    firsts: dict[str, tuple[int, int, int]] = {}
    r0 = 0
    for name, code, sel in groups:
        signs = (_sign_rows(c.head_dim[sel], c.layer[sel], c.seed[sel]) if code == rows_.DEC_TQ and len(sel)
                 else _NO_SIGNS)
        units = rows_.decode_group(q, w, r0, code, sel, ans, c.src, c.dst, c.stored, c.orig, c.fp16, c.head_dim,
                                   c.bits, c.role, c.expect, c.scratch, c.chunk0, signs, actual, status, km.CHUNK,
                                   km.TQ_VECTORS_PER_UNIT, ans_format.CHUNK_BYTES)
        firsts[name] = (r0, len(sel), units)
        r0 += len(sel)
    _put_rows(buf, at, q)
    return firsts


def _dec_fixed(m: np.ndarray) -> np.ndarray:
    """The part of a non-ANS decode batch's workspace estimate (``_dec_estimate``) that depends on its
    segment count ``m``."""
    return (-(-(2 * m * km.SEG_DTYPE.itemsize) // SLOT_ALIGN) * SLOT_ALIGN
            + -(-(16 * m) // SLOT_ALIGN) * SLOT_ALIGN + _up(44) + 4 * 256)


def _dec_layout_fixed(k: int, chunks: int) -> "tuple[_Layout, dict[str, int]]":
    """The head of a decode batch's workspace (descriptors, ANS chunk arrays, meta, chunk sizes and
    statuses), everything the host uploads or reads back; the payloads are staged after ``down_end``."""
    lay = _Layout()
    off = {"desc": lay.take(2 * max(k, 1) * km.SEG_DTYPE.itemsize), "chunk_in": lay.take(32 * max(chunks, 1))}
    off["meta"] = lay.take(16 * max(k, 1))
    off["chunk_actual"] = lay.take(8 * max(chunks, 1), 8)
    off["chunk_status"] = lay.take(4 * max(chunks, 1), 4)
    off["down_end"] = lay.end
    return lay, off


def _mirror(host: np.ndarray, stored: np.ndarray, lay: _Layout) -> "tuple[np.ndarray, list[tuple[int, int]]]":
    """Staging offsets (taken from ``lay``) of payloads uploaded from pinned host addresses ``host``: a run of
    payloads that lie one after another there (steps that keep the 256-byte alignment, gaps of at most
    ``_MIRROR_GAP``: a save batch leaves them so in the arena) keeps its relative offsets, so that it goes up
    in one copy (:func:`~orbitkv_fs.gpu.rows.mirror`). Answers the offsets and the runs as ``[start, end)`` row
    ranges."""
    k = len(host)
    staged, starts = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
    runs, lay.end = rows_.mirror(np.asarray(host, dtype=np.int64), np.asarray(stored, dtype=np.int64), lay.end,
                                 SLOT_ALIGN, _MIRROR_GAP, staged, starts)
    first = starts[:runs].tolist()
    return staged, list(zip(first, first[1:] + [k]))


_FIXED_PARTS: dict[Callable[[np.ndarray], np.ndarray], np.ndarray] = {}


def _prefix_batches(plans: list, sizes: np.ndarray, fixed: Callable[[np.ndarray], np.ndarray], limit: int,
                    extra: int = 0, even: bool = False) -> "list | None":
    """``plans`` cut into batches as the per-segment fit rule cuts them: each as long as ``fixed(count) + extra +
    its sizes`` stays within ``limit``, at most MAX_BATCH; one cumulative sum instead of an estimate per segment.
    None when some plan does not fit alone (the per-segment rule then decides what to do with it). ``fixed``'s
    table is kept per function: pass a module-level one, not a new closure per call. ``even``: as many batches,
    cut at equal shares of the bytes where those fit too.

    The greedy cut makes the fewest batches (a run within a batch that fits fits too), so when the cut at equal
    shares into the least count the bytes allow (each batch holds at most ``limit`` less one segment's fixed
    part) fits, it is the answer, found without the greedy pass: a Manager batch of one or two flights."""
    k = len(plans)
    tab = _FIXED_PARTS.get(fixed)
    if tab is None:  # the fixed part of every batch size, once per rule
        tab = _FIXED_PARTS[fixed] = fixed(np.arange(1, MAX_BATCH + 1, dtype=np.int64))
    if k and int(tab[0] + extra + sizes.max()) > limit:
        return None
    limit -= extra
    ends = np.cumsum(sizes)
    if not k:
        return []
    least = -(-int(ends[-1]) // max(limit - int(tab[0]), 1))
    if least <= 1 and k <= MAX_BATCH and int(tab[k - 1] + ends[-1]) <= limit:
        return [plans]
    if even and least > 1:
        got = _even_cut(plans, ends, tab, limit, least)
        if got is not None:
            return got
    out = []
    start = 0
    while start < k:
        m = min(MAX_BATCH, k - start)
        est = tab[:m] + ends[start:start + m] - (ends[start - 1] if start else 0)
        count = int(np.count_nonzero(est <= limit))  # est grows with the count: its prefix fits
        out.append(plans[start:start + count])
        start += count
    if even and len(out) > 1:
        return _even_cut(plans, ends, tab, limit, len(out)) or out
    return out


def _even_cut(plans: list, ends: np.ndarray, tab: np.ndarray, limit: int, m: int) -> "list | None":
    """``plans`` (their sizes' running sums ``ends``) cut into ``m`` batches at equal shares of the bytes, or None
    where a batch would be empty, pass MAX_BATCH or not fit ``limit`` (``tab``: the fixed part by count)."""
    k = len(plans)
    cuts = np.concatenate([[0], np.searchsorted(ends, ends[-1] * np.arange(1, m) / m) + 1, [k]])
    count = np.diff(cuts)
    if (count > 0).all() and (count <= MAX_BATCH).all():
        part = ends[cuts[1:] - 1] - np.concatenate([[0], ends[cuts[1:-1] - 1]])
        if (tab[count - 1] + part <= limit).all():
            return [plans[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]
    return None


def _temp_batches(sizes: np.ndarray, fixed: Callable[[np.ndarray], np.ndarray], limit: int,
                  temp_of: Callable[[np.ndarray], int]) -> "list | None":
    """Rows ``0..n-1`` cut as :func:`_prefix_batches` cuts them by ``sizes``, each batch also holding nvCOMP's
    temp (``temp_of(rows)``, growing with a batch's chunks and bytes): cut against the limit less the largest
    temp of the previous cut until every batch fits (a few rounds: the temp only falls as batches shrink).
    None when no cut fits."""
    rows, temp = np.arange(len(sizes)), 0
    for _ in range(4):
        if limit - temp <= 0:
            return None
        batches = _prefix_batches(rows, sizes, fixed, limit - temp)
        if batches is None:
            return None
        need = max(temp_of(b) for b in batches)
        if need <= temp:
            return batches
        temp = need
    return None


class _AnsRounds(NamedTuple):
    """An encode batch's ANS segments (in packing order: by nvCOMP type) cut into rounds that share one set of
    chunk output buffers: nvCOMP compresses a round's chunks into them, ``okv_ans_place`` and ``okv_ans_pack``
    move the round into its slots, then the next round reuses them (one stream orders the three)."""

    chunk0: np.ndarray  # each segment's first chunk in the batch's chunk arrays
    at: np.ndarray  # each segment's first chunk buffer within the round's buffers
    rounds: "list[tuple[int, int, int, list[tuple[AnsType, int, int]]]]"  # lo, hi, chunks, nvCOMP calls
    chunks: int  # chunk buffers (the largest round's chunks)


def _ans_rounds(nch: np.ndarray, types: np.ndarray, limit: int) -> _AnsRounds:
    """The rounds of ANS segments of ``nch`` chunks and nvCOMP ``types`` each (sorted by type): consecutive
    segments, as many as keep a round's chunks within ``limit`` (a wider segment alone), and per round one nvCOMP
    call per type (its type, first chunk and chunk count). Per round, not per segment: bisections over the
    chunk counts' running sums."""
    ends = np.cumsum(nch)
    chunk0 = ends - nch
    e, k = ends.tolist(), len(nch)
    cuts = [0]
    while cuts[-1] < k:
        lo = cuts[-1]
        cuts.append(max(lo + 1, bisect_right(e, (e[lo - 1] if lo else 0) + limit, lo, k)))
    if len(cuts) == 2:
        at = chunk0
    else:
        cut = np.asarray(cuts)
        at = chunk0 - np.repeat(chunk0[cut[:-1]], np.diff(cut))
    changes = (np.flatnonzero(types[1:] != types[:-1]) + 1).tolist()  # where the type changes (sorted)
    tl = types[[0] + changes].tolist()  # the type from each change on
    rounds = []
    for lo, hi in zip(cuts, cuts[1:]):
        starts = [lo] + changes[bisect_right(changes, lo):bisect_left(changes, hi)]
        first = [e[x - 1] if x else 0 for x in starts]
        last = first[1:] + [e[hi - 1]]
        calls = [(AnsType(tl[bisect_right(changes, x)]), f, m - f) for x, f, m in zip(starts, first, last)]
        rounds.append((lo, hi, last[-1] - first[0], calls))
    return _AnsRounds(chunk0, at, rounds, max(r[2] for r in rounds))


def _item(obj: Any) -> EncodeItem:
    if isinstance(obj, EncodeItem):
        return obj
    if isinstance(obj, (tuple, list)) and 2 <= len(obj) <= 5:
        return EncodeItem(*obj)
    raise CodecError(f"encode item must be EncodeItem or (array, codec, role, layer[, dtype]), not {type(obj).__name__}")


class GpuCodecEngine:
    """Batched GPU encode (save) and decode (restore) of segments; see the module docstring."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, *, seed: int = 0, fp8_arithmetic: bool = False) -> None:
        if budget_bytes < (1 << 20):
            raise CodecError(f"codec workspace budget {budget_bytes} is under 1 MiB")
        self.budget_bytes = budget_bytes
        self.seed = seed
        # Encode classification per item shape (codec, role, layer, dtype, bytes, ...): a batch's items share
        # a few, so each distinct one is validated once; and header template rows per distinct field set.
        self._classes: dict[tuple, _Enc] = {}
        self._rows: dict[tuple, tuple[bytes, int]] = {}
        self._class_sets: dict[tuple, _ClassSet] = {}  # encode_columns_submit's, by their classes' identities
        # Per (class set, class vector, alignment): a batch's flight cuts, a flight's _FlightPlan. Each entry
        # holds its class set, whose id in the key is then not reused while the entry lives.
        self._plans: dict[tuple, tuple] = {}
        # decode_columns_submit's flight cuts and _DecPlans, by the headers' fixed_words
        self._dec_plans: dict[bytes, tuple] = {}
        # Device copies for okv_write_headers, by id of what they copy (held in the entry: its id stays its own):
        # a _FlightPlan's header rows, a _ClassSet's templates and header CRCs. Allocated on the save stream, so
        # that memory freed with an entry is reused only after the flights queued on it.
        self._dev_headers: dict[int, tuple] = {}
        self._ans_packed = 1.0  # the last encode batch's packed ANS bytes over their worst case (the download's guess)
        self._kernels = km.kernels(arith=fp8_arithmetic)
        self.save = Worker("save", budget_bytes)
        self.restore = Worker("restore", budget_bytes)
        self._nvcomp = None

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Drain both streams and free both workspaces. The engine can be used again afterwards."""
        self.save.close()
        self.restore.close()

    def __enter__(self) -> "GpuCodecEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: launches, h2d_copies, d2h_copies, syncs, wait_ns (the host blocked on this worker's
        streams: a CUDA wait spins, so thread CPU time counts it too), batches, segments (in GPU batches),
        cpu_fallbacks, raw_fallbacks, ans_rounds (rounds of ANS compression, see _AnsRounds), ans_tail_fetches,
        and the workspace size and grows (per worker)."""
        out: dict[str, int] = {}
        for w in (self.save, self.restore):
            for key, v in w.stats.items():
                out[f"{w.name}_{key}"] = v
            out[f"{w.name}_workspace_bytes"] = w.ws.size
            out[f"{w.name}_workspace_grows"] = w.ws.grows
        return out

    def nvcomp(self):
        if self._nvcomp is None:
            from . import nvcomp

            self._nvcomp = nvcomp.load()
        return self._nvcomp

    # -- page blocks ---------------------------------------------------------------------------
    def block_buffer(self, nbytes: int, *, restore: bool) -> Any:
        """A cupy uint8 array for gathered (save) or to-be-scattered (restore) blocks, allocated on that
        worker's stream: cupy's pool then hands its memory out again only to work on the same stream,
        which is ordered after the copies still reading it."""
        with (self.restore if restore else self.save).stream:
            return cp.empty(nbytes, dtype=cp.uint8)

    def gather_blocks(self, table: np.ndarray) -> None:
        """Queue the page-block copies of ``table`` (:data:`~orbitkv_fs.gpu.tables.BLOCK_COPY_DTYPE` rows)
        on the save worker's stream, after the caller's current stream: the next :meth:`encode_batch`
        reads what they gather (same stream), one launch for every block of a batch."""
        if table.dtype != km.BLOCK_COPY_DTYPE:
            raise CodecError(f"block table must have dtype BLOCK_COPY_DTYPE, not {table.dtype}")
        w = self.save
        with w.lock:
            w.wait_for_current()
            w.copy_blocks(self._kernels, table)

    def scatter_blocks(self, table: np.ndarray) -> Any:
        """Queue the copies of ``table`` 's blocks on the restore worker's scatter stream, after the caller's
        current stream. Their sources must be complete or queued on that stream: a decode's temporary once
        :meth:`decode_collect` has returned for it (the restore stream's later batches are not waited for).
        Work queued on the restore stream from now on waits for these copies (a temporary they read is handed
        out again on that stream). Returns a CUDA event: the blocks are written once it has completed
        (synchronise it before an engine may read its pages)."""
        if table.dtype != km.BLOCK_COPY_DTYPE:
            raise CodecError(f"block table must have dtype BLOCK_COPY_DTYPE, not {table.dtype}")
        w = self.restore
        with w.lock:
            w.handoff(w.scatters, cp.cuda.get_current_stream())
            done = w.copy_blocks(self._kernels, table, w.scatters)
            w.stream.wait_event(done)
            return done

    # -- encode --------------------------------------------------------------------------------
    def encode_class(self, item: Any) -> _Enc:
        """The encode class of sources like ``item`` 's (an EncodeItem; of its array only the size, shape and
        dtype count, not the address): the codec's decisions and the header fields, validated once (raises
        CodecError as :meth:`encode_submit`). For :meth:`encode_columns_submit`."""
        it = _item(item)
        arr = _span(it.array)
        if arr is None:
            raise CodecError(f"encode needs a cupy array or DeviceSpan, not {type(it.array).__name__}")
        return self._classify(0, EncodeItem(DeviceSpan(0, arr.nbytes, arr.shape), it.codec, it.role, it.layer,
                                            it.dtype if it.dtype is not None else it.array.dtype, it.raw_reason))

    def _classify(self, i: int, it: EncodeItem) -> _Enc:
        arr = _span(it.array)
        if arr is None:
            if isinstance(it.array, cp.ndarray):
                raise CodecError(f"item {i}: source array is not C-contiguous")
            raise CodecError(f"item {i}: encode needs a cupy array or DeviceSpan, not {type(it.array).__name__}")
        if it.dtype is None and isinstance(it.array, DeviceSpan):
            raise CodecError(f"item {i}: a DeviceSpan source needs the item's dtype")
        key = (it.codec, it.role, it.layer, it.dtype if it.dtype is not None else it.array.dtype, it.raw_reason,
               arr.nbytes, arr.shape, arr.ptr % 8 == 0)
        t = self._classes.get(key)
        if t is None:
            t = self._classify_new(i, it, arr)
            if len(self._classes) >= 4096:
                self._classes.clear()
            self._classes[key] = t
        return _Enc(i, it, arr.ptr, t.n, t.dtype, t.role, t.layer, t.kind, t.reason, t.shape, t.head_dim, t.bits,
                    t.ans_type, t.cap, 0, 0, t.nch, 0, 0, t.head)

    def _classify_new(self, i: int, it: EncodeItem, arr: DeviceSpan) -> _Enc:
        """The plan of an item of a shape not seen before (validated; raises CodecError), ``head`` included."""
        e = self._classify_fields(i, it, arr)
        if e.kind in ("raw", "fp8", "tq", "ans"):
            fmt = {"raw": Format.RAW, "fp8": Format.FP8, "tq": Format.TURBOQUANT, "ans": Format.ANS}[e.kind]
            tq = e.kind == "tq"
            stored = e.n if e.kind == "raw" else e.cap
            # Plain ints: a tuple with a numpy dtype or enum members hashes through Python-level __hash__ calls
            # (tens of microseconds for an ml_dtypes dtype), and batches hash these tuples.
            try:
                code = dtype_code(e.dtype)
            except SegmentError as err:  # a dtype the segment format has no code for
                raise CodecError(f"item {i}: {err}") from None
            e.head = (int(fmt), code, e.n, stored, int(e.role), e.layer, e.bits, e.head_dim, int(tq),
                      self.seed if tq else 0, int(e.ans_type), int(e.reason) if fmt == Format.RAW else 0)
        return e

    def _classify_fields(self, i: int, it: EncodeItem, arr: DeviceSpan) -> _Enc:
        if it.codec not in CODEC_NAMES:
            raise CodecError(f"item {i}: unknown codec {it.codec!r}; expected one of {', '.join(CODEC_NAMES)}")
        role = Role.parse(it.role)
        if not 0 <= it.layer <= 0xFFFF:
            raise CodecError(f"item {i}: layer {it.layer} outside 0..65535")
        dtype = np.dtype(it.dtype) if it.dtype is not None else np.dtype(it.array.dtype)
        n = arr.nbytes
        if n % dtype.itemsize:
            raise CodecError(f"item {i}: {n} bytes are not whole {dtype} items")
        if n > MAX_STORED_BYTES:
            raise CodecError(f"item {i}: segment of {n} bytes exceeds the {MAX_STORED_BYTES}-byte segment bound")
        e = _Enc(i, it, arr.ptr, n, dtype, role, it.layer, "raw", shape=arr.shape)
        c = it.codec
        if c == "none":
            e.reason = it.raw_reason
            return e
        if n > MAX_SOURCE_BYTES:
            e.reason = RawReason.TOO_LARGE
            return e
        if c == "fp8":
            if dtype not in (BF16, FP16):
                e.reason = RawReason.UNSUPPORTED
            elif not worth_keeping(n, n // 2):
                e.kind = "host"  # tiny: the host codec decides between range rejection and NOT_SMALLER
            else:
                e.kind, e.cap, e.bits = "fp8", n // 2, 8
            return e
        if c.startswith("turboquant"):
            bits = int(c[-1])
            d = int(arr.shape[-1]) if arr.shape else 0
            if dtype not in (BF16, FP16) or role not in (Role.KEY, Role.VALUE) or d not in TURBOQUANT_HEAD_DIMS:
                e.reason = RawReason.UNSUPPORTED
                return e
            stored = turboquant_stored_bytes(n, d, bits, role)
            if not worth_keeping(n, stored):
                e.kind = "host"
            else:
                e.kind, e.cap, e.bits, e.head_dim = "tq", stored, bits, d
            return e
        # ans
        if n < ANS_MIN_BYTES or n % 8 or e.ptr % 8:
            e.reason = RawReason.UNSUPPORTED
            return e
        e.kind, e.ans_type = "ans", ans_type_of(dtype)
        e.nch = ans_format.chunk_count(n)
        e.cap = ans_format.keep_capacity(n)  # a larger payload would be stored raw anyway
        return e

    def _chunk_cap(self) -> int:
        """Bytes of one chunk's nvCOMP output buffer (worst case for 64 KiB)."""
        return _up(self.nvcomp().max_compressed_bytes(ans_format.CHUNK_BYTES, AnsType.BYTES))

    def _enc_layout(self, plans: Sequence[_Enc], align: int,
                    ans: Sequence[_Enc] = ()) -> "tuple[dict[str, int], int, _AnsRounds | None]":
        """Offsets of one encode batch in the workspace, its total size and its ANS rounds. Assigns slots and
        chunks: the ANS segments' (``ans``, in their packing order) last, from ``off["ans_slot0"]``, at their
        worst case (the region's size; ``okv_ans_place`` then packs them from there); their chunk buffers
        within one round's (``_AnsRounds``), then nvCOMP's temp for a round."""
        k = len(plans)
        order = [p for p in plans if p.kind != "ans"] + list(ans) if ans else plans
        n_desc = sum(p.kind in ("fp8", "tq") for p in plans) + sum(p.kind in ("raw", "tq", "ans") for p in plans)
        n_desc += len(ans)
        sizes = np.fromiter([HEADER_SIZE + (p.cap if p.kind != "raw" else p.n) for p in order], np.int64, count=k)
        lay, off, slots = _enc_offsets(k, n_desc, sum(p.nch for p in ans), len(ans), sizes, align)
        for p, slot in zip(order, slots.tolist()):
            p.slot = slot
        off["ans_slot0"] = ans[0].slot if ans else off["region_end"] - off["meta"]
        if not ans:
            off["temp"], off["temp_len"] = lay.take(0), 0
            return off, lay.end, None
        nch = np.fromiter((p.nch for p in ans), dtype=np.int64, count=len(ans))
        types = np.fromiter((p.ans_type for p in ans), dtype=np.int64, count=len(ans))
        rounds = _ans_rounds(nch, types, self._round_chunks(int(nch.max())))
        cap = self._chunk_cap()
        buf = lay.take(rounds.chunks * cap)
        for p, c0, at in zip(ans, rounds.chunk0.tolist(), rounds.at.tolist()):
            p.chunk0, p.tmp = c0, buf + cap * at
        off["temp_len"] = self._round_temp(rounds.chunks, types.tolist())
        off["temp"] = lay.take(off["temp_len"])
        return off, lay.end, rounds

    def _round_chunks(self, widest: int) -> int:
        """The most chunks of one round of a batch's ANS compression (:class:`_AnsRounds`): ANS_ROUND_SHARE of
        the half workspace, or ``widest`` (one segment's chunks) when more."""
        return max(widest, self.budget_bytes // 2 // ANS_ROUND_SHARE // self._chunk_cap())

    def _round_temp(self, chunks: int, types: "Iterable[int]") -> int:
        """nvCOMP's compression temp bytes for a round of ``chunks`` chunks (the largest over its data types)."""
        nv, cb = self.nvcomp(), ans_format.CHUNK_BYTES
        return max(nv.compress_temp_bytes(chunks, cb, chunks * cb, AnsType(t)) for t in set(types))

    def _round_bytes(self, widest: int, types: "Iterable[int]") -> int:
        """The workspace an encode batch's ANS rounds take besides their slots and chunk arrays, at most: one
        round's chunk buffers and nvCOMP temp, each aligned (``widest``: the most chunks of one segment)."""
        rc = self._round_chunks(widest)
        return rc * self._chunk_cap() + self._round_temp(rc, types) + 2 * SLOT_ALIGN

    def _enc_estimate(self, fill: "_Fill", align: int) -> int:
        """Upper bound of :meth:`_enc_layout` 's total for a batch of these totals (``fill.bytes``: slots)."""
        k, na, chunks = fill.k, fill.ans, fill.chunks
        fixed = _up(4 * k * km.SEG_DTYPE.itemsize) + _up(16 * k) + _up(8 * (na + 1)) + 4 * 256
        fixed += align - SLOT_ALIGN  # the region starts at a slot boundary
        if not na:
            return fixed + fill.bytes
        return fixed + fill.bytes + chunks * 36 + 3 * 256 + self._round_bytes(fill.widest, fill.types)

    def encode_batch(self, items: Sequence[Any], *, out_region: "Callable[[int], np.ndarray | None] | None" = None,
                     slot_align: int = SLOT_ALIGN,
                     device_sink: "Callable[[int, Any], None] | None" = None) -> "list[memoryview | bytes]":
        """Encode ``items`` (EncodeItem or (array, codec, role, layer[, dtype])) into complete segments.

        Returns, in order, one segment per item: a memoryview into a pinned host buffer (header followed
        by payload, exactly ``64 + stored_length`` bytes) or ``bytes`` for fallbacks. Raises CodecError
        for invalid items (unknown codec, non-contiguous or non-cupy array, over 32 MiB).

        ``out_region(nbytes)``, when given, supplies each batch's pinned host region (the Manager's arena:
        segments then land where they will be stored, with no host copy); None from it means "use a
        buffer of your own". Segments start at multiples of ``slot_align`` inside the region.

        ``device_sink(i, segment)``, when given, also gets each segment the GPU encoded (not the host
        fallbacks: CPU-encoded segments and raw fallbacks exist only on the host) as a 1-D cupy uint8 view
        of the workspace, header and payload exactly as in the returned bytes (the headers are copied up
        for it, one 64-byte copy each). It is called once the batch's stream work is complete, and the
        view is reused by a later batch: the sink must be done with it when it returns (a synchronous
        write, or a device-to-device copy it has synchronised).

        Same as :meth:`encode_collect` of :meth:`encode_submit`.
        """
        return self.encode_collect(self.encode_submit(items, out_region=out_region, slot_align=slot_align,
                                                      device_sink=device_sink))

    def encode_submit(self, items: Sequence[Any], *, out_region: "Callable[[int], np.ndarray | None] | None" = None,
                      slot_align: int = SLOT_ALIGN,
                      device_sink: "Callable[[int, Any], None] | None" = None) -> "EncodeJob":
        """Start encoding ``items`` (arguments as :meth:`encode_batch`): the GPU batches are queued and the
        last one is left running, so that the caller can prepare (gather, submit) the next request's
        batch before :meth:`encode_collect` waits for this one. Sources must stay untouched until then."""
        plans = [self._classify(i, _item(x)) for i, x in enumerate(items)]
        job = EncodeJob.of(len(plans))
        w = self.save
        with w.lock:
            w.wait_for_current()
            try:
                plain = self._plain_batches(plans, slot_align)
                if plain is not None:
                    for batch in plain:
                        job.flights.append(self._run_encode(batch, job, out_region, slot_align, device_sink))
                    return job
                gpu: list[_Enc] = []
                fill = _Fill()
                half = self.budget_bytes // 2
                for p in plans:
                    slot = _up(HEADER_SIZE + (p.n if p.kind == "raw" else p.cap), slot_align)
                    one = _Fill.of(slot, p.nch, p.n, p.ans_type) if p.kind == "ans" else None
                    more = fill.add(one) if one is not None else fill.plus(slot)
                    # One estimate per segment where it joins the batch (then it alone fits too).
                    if p.kind != "host" and len(gpu) < MAX_BATCH and self._enc_estimate(more, slot_align) <= half:
                        gpu.append(p)
                        fill = more
                        continue
                    one = one or _Fill.of(slot)
                    if p.kind == "host" or self._enc_estimate(one, slot_align) > self.budget_bytes:
                        if p.kind != "host":
                            w.stats["cpu_fallbacks"] += 1  # the workspace cannot hold this segment
                        job.out[p.i] = self._host_encode(p)
                        continue
                    if gpu:
                        job.flights.append(self._run_encode(gpu, job, out_region, slot_align, device_sink))
                    gpu, fill = [p], one
                if gpu:
                    job.flights.append(self._run_encode(gpu, job, out_region, slot_align, device_sink))
            except BaseException:  # nothing of this call may run on into buffers the caller reclaims
                w.drop(job.flights)
                raise
        return job

    def encode_columns_submit(self, classes: Sequence[_Enc], cls: np.ndarray, ptrs: np.ndarray, *,
                              out_region: "Callable[[int], np.ndarray | None] | None" = None,
                              slot_align: int = SLOT_ALIGN) -> "EncodeJob | None":
        """:meth:`encode_submit` of sources given as arrays, with no Python per segment: source ``i`` is
        ``ptrs[i]`` (a device address, C-contiguous) of class ``classes[cls[i]]`` (:meth:`encode_class`).
        The job's ``out`` holds a segment only where it lies outside ``out_region`` 's arrays (a raw fallback,
        or a batch the region could not take); the others are described by the job's arrays (``addr``,
        ``length``, ...). Answers None, queueing nothing, when a class is not a GPU encode (one the host codec
        decides) or a segment needs more than half the workspace alone: :meth:`encode_submit` takes those."""
        cs = self._class_set(classes)
        if cs is None:
            return None
        cls = np.asarray(cls, dtype=np.int64)
        ptrs = np.asarray(ptrs, dtype=np.int64)
        k = len(cls)
        key = ("cuts", id(cs), cls.tobytes(), slot_align)
        batches = self._plans.get(key, (cs, False))[1]
        if batches is False:  # the flights' rows: the same for the same class vector
            is_ans = cs.table.kind[cls] == _KIND["ans"]
            if is_ans.any():
                batches = self._ans_cuts(np.arange(k), cs.size[cls], np.where(is_ans, cs.table.nch[cls], 0),
                                         np.unique(cs.ans_type[cls[is_ans]]).tolist(), slot_align)
            else:
                batches = self._enc_cuts(np.arange(k), cs.size[cls], slot_align)
            if batches is not None:
                batches = [_frozen(np.asarray(b)) for b in batches]
            _remember(self._plans, key, (cs, batches))
        if batches is None:
            return None
        job = EncodeJob.of(k)
        w = self.save
        with w.lock:
            w.wait_for_current()
            try:
                for rows in batches:
                    job.flights.append(self._run_encode_columns(cs, cls, ptrs, rows, job, out_region, slot_align))
            except BaseException:  # nothing of this call may run on into buffers the caller reclaims
                w.drop(job.flights)
                raise
        return job

    def _class_set(self, classes: Sequence[_Enc]) -> "_ClassSet | None":
        """The :class:`_ClassSet` of ``classes`` (made on first sight of the sequence, by the identities of its
        classes); None when one is not a GPU encode (one the host codec decides)."""
        key = tuple(map(id, classes))
        cs = self._class_sets.get(key)
        if cs is None:
            if any(t.kind not in ("raw", "fp8", "tq", "ans") for t in classes):
                return None
            size = np.fromiter((HEADER_SIZE + (t.n if t.kind == "raw" else t.cap) for t in classes),
                               dtype=np.int64, count=len(classes))
            stored = np.fromiter((t.head[3] for t in classes), dtype=np.int64, count=len(classes))
            tids, rows, bases = self._template_ids([t.head for t in classes])
            if len(self._class_sets) >= 256:
                self._class_sets.clear()
            cs = self._class_sets[key] = _ClassSet(tuple(classes), _enc_cols(classes), size, stored, rows[tids],
                                                   bases[tids], _ints(classes, "ans_type"))
        return cs

    def _header_consts(self, cs: _ClassSet, c: np.ndarray, plan: _FlightPlan) -> tuple[int, int, int]:
        """Device addresses of ``okv_write_headers``' inputs for a flight of ``plan`` (classes ``c`` of ``cs``):
        the plan's header rows (each segment's slot, template, Meta row and walked bytes), the class set's
        templates and their header CRCs. Each uploaded once, on the save stream, and kept with what it copies.
        An entry the memo drops frees its memory to the save stream's pool, so a later use of it is ordered
        after the flights queued with it."""
        memo = self._dev_headers
        got, consts = memo.get(id(plan)), memo.get(id(cs))
        if got is None or consts is None:
            # Cleared once, before either entry goes in: the kernel gets raw pointers only, so both arrays must
            # stay held until a later flight, not be dropped by the second insertion's clear.
            if len(memo) + 2 > PLANS_KEPT:
                memo.clear()
            with self.save.stream:
                if got is None:
                    got = (plan, cp.asarray(_header_rows(c, plan).view(np.uint8)))
                if consts is None:
                    consts = (cs, cp.asarray(np.ascontiguousarray(cs.templates)), cp.asarray(cs.bases.astype(np.uint32)))
            memo[id(plan)], memo[id(cs)] = got, consts
        return int(got[1].data.ptr), int(consts[1].data.ptr), int(consts[2].data.ptr)

    def _run_encode_columns(self, cs: _ClassSet, cls: np.ndarray, ptrs: np.ndarray, rows: np.ndarray, job: EncodeJob,
                            out_region: "Callable[[int], np.ndarray | None] | None", align: int) -> _Flight:
        """Queue one encode batch of :meth:`encode_columns_submit` (``rows``: its sources' indices there): its
        columns from the class table, its descriptors (and ANS chunk arrays) up, the kernels and nvCOMP, the
        download into ``out_region``. ANS segments as :meth:`_run_encode` lays them out: by type, their slots
        last (packed on the GPU), their chunks and nvCOMP buffers in that order."""
        w = self.save
        c = cls[rows]
        k = len(rows)
        key = (id(cs), c.tobytes(), align)
        plan = self._plans.get(key, (cs, None))[1]
        if plan is None:
            plan = _remember(self._plans, key, (cs, _flight_plan(cs, c, cs.table.kind[c], align, self.seed, self)))[1]
        off, a = plan.off, plan.ans
        ans = len(a) > 0
        if ans:  # the download up to the packed end the previous batch suggests (as _run_encode)
            off = dict(off)
            worst = off["region_end"] - off["meta"] - off["ans_slot0"]
            off["download"] = off["ans_slot0"] + min(worst, _up(int(worst * min(1.0, self._ans_packed + ANS_MARGIN)),
                                                                align))
        base, upload = w.place(plan.total)
        region = base + off["meta"]
        src = ptrs[rows]
        up = upload.get(plan.upload)
        up[off["meta"]:] = 0
        got = _encode_rows(up, off["desc"], plan.cols._replace(ptr=src), plan.groups, region + HEADER_SIZE,
                           self.seed, plan.chunk_cap, base, off, plan.rounds, signs=plan.signs)
        if ans:  # per chunk: source address, source bytes, output buffer
            chunk = len(plan.chunk_at)
            arr = up[off["chunk_in"]:off["chunk_in"] + 24 * chunk].view("<u8").reshape(3, chunk)
            arr[0] = np.repeat(src[a], plan.nch) + plan.chunk_at
            arr[1] = plan.chunk_fixed[0]
            arr[2] = plan.chunk_fixed[1] + base
        w.h2d(base, up)
        host, own = self._launch_encode(base, off, got, plan.groups, k, out_region, plan.rounds,
                                        len(plan.chunk_at), plan.temp, align, self._header_consts(cs, c, plan))
        return w.launched(base, plan.total, upload, lambda: self._finish_encode_columns(
            cs, c, rows, src, plan.slots, job, host, own, off, a, region, plan.kind, plan.walked), w.copies)

    def _finish_encode_columns(self, cs: _ClassSet, c: np.ndarray, rows: np.ndarray, ptrs: np.ndarray,
                               slots: np.ndarray, job: EncodeJob, host: np.ndarray, views: bool, off: dict[str, int],
                               a: np.ndarray, region: int, kind: np.ndarray, walked: np.ndarray) -> None:
        """The host part of a flight of :meth:`encode_columns_submit` (its :class:`_FlightPlan`'s ``slots``,
        ``ans``, ``kind`` and ``walked``) whose stream work has completed. ``okv_write_headers`` wrote the
        headers, so the host touches none of the region's header lines: it reads the statuses and the ANS
        payload lengths, packs the ANS slots as the GPU did, and fills the job's fields from the templates (ANS
        stored lengths as a column); per-segment Python only for a segment that falls back to raw storage.
        ``views``: the region is the engine's own array, so ``out`` gets each segment's view."""
        w, out = self.save, job.out
        k = len(rows)
        meta = host[:16 * k].view(km.META_DTYPE)
        status = meta["status"]
        bad = (status != 0) & (kind != _KIND["raw"])
        ans = len(a) > 0
        if ans:
            a_off = off["pay_len"] - off["meta"]
            size = host[a_off:a_off + 8 * len(a)].view("<u8").astype(np.int64)
            walked = walked.copy()
            bad[a] |= (size == 0) | (size > walked[a])  # over the class's capacity: not worth keeping
            walked[a] = size
            slots = slots.copy()
            slots[a] = self._packed_slots(size, off, host, region)
        keep = ~bad
        for j in np.flatnonzero(bad).tolist():
            t = cs.classes[int(c[j])]
            st = int(status[j])
            if t.kind == "ans":
                reason = RawReason.UNSUPPORTED if st & km.ST_ANS_FAILED else RawReason.NOT_SMALLER
            else:
                reason = RawReason.NONFINITE if st & km.ST_NONFINITE else RawReason.OUT_OF_RANGE
            w.stats["raw_fallbacks"] += 1
            p = msgspec.structs.replace(t, i=int(rows[j]), ptr=int(ptrs[j]))
            out[p.i] = raw_segment(self._host_source(p), role=p.role, layer=p.layer, reason=reason)
        good = np.flatnonzero(keep) if not keep.all() else np.arange(k)
        if not good.size:
            return
        _write_headers(job, host, cs.templates, cs.bases, c[good], None, slots[good], rows[good], views=views,
                       stored=walked[good] if ans else None)

    def _plain_batches(self, plans: list[_Enc], align: int) -> "list[list[_Enc]] | None":
        """The GPU batches of ``plans`` when none is host-encoded and each fits half the workspace alone, found
        with one cumulative sum: with no ANS segment the batches the per-segment fit check of
        :meth:`encode_submit` would form (each as long as its estimate stays within half the workspace, at most
        MAX_BATCH); with ANS segments :meth:`_ans_cuts`, as :meth:`encode_columns_submit` cuts them. None
        otherwise (that loop then decides)."""
        if any(p.kind == "host" for p in plans):
            return None
        k = len(plans)
        sizes = np.fromiter([HEADER_SIZE + (p.n if p.kind == "raw" else p.cap) for p in plans], np.int64, count=k)
        ans = [p for p in plans if p.kind == "ans"]
        if not ans:
            return self._enc_cuts(plans, sizes, align)
        nch = np.fromiter([p.nch if p.kind == "ans" else 0 for p in plans], np.int64, count=k)
        return self._ans_cuts(plans, sizes, nch, {p.ans_type for p in ans}, align)

    def _ans_cuts(self, items: Sequence, sizes: np.ndarray, nch: np.ndarray, types: "Iterable[int]",
                  align: int) -> "list | None":
        """``items``, ANS ones among them (``nch``: each one's chunks, 0 for the others), cut into GPU batches by
        their segments' ``sizes``: each slot rounded up to ``align``, an ANS segment's chunk arrays and payload
        length beside it, and per batch one round's chunk buffers and nvCOMP temp (:class:`_AnsRounds`), against
        half the workspace (:func:`_prefix_batches`), then evened out: as many batches, of about equal bytes. A
        save hands over one Manager batch at a time; a short last flight of it left the copies idle while the
        host formed the next (docs/results/2026-12-03-ans-rounds)."""
        slots = -(-sizes // align) * align + np.where(nch > 0, nch * 36 + 8, 0)
        extra = 4 * 256 + self._round_bytes(int(nch.max()), types)
        return _prefix_batches(items, slots, _enc_fixed(align), self.budget_bytes // 2, extra, even=True)

    def _enc_cuts(self, items: Sequence, sizes: np.ndarray, align: int) -> "list | None":
        """``items`` (none ANS) cut into GPU batches by their segments' ``sizes`` (header and payload), each
        slot rounded up to ``align``: :func:`_prefix_batches` against half the workspace, evened out (a Manager
        batch of two flights' bytes is two flights of equal bytes, not one full and a sliver)."""
        return _prefix_batches(items, -(-sizes // align) * align, _enc_fixed(align), self.budget_bytes // 2,
                               even=True)

    def encode_collect(self, job: "EncodeJob") -> "list[memoryview | bytes]":
        """Wait for a submitted encode and answer its segments (as :meth:`encode_batch`)."""
        w = self.save
        with w.lock:
            for f in job.flights:
                w.finish(f)
        return job.out  # type: ignore[return-value]

    def _host_source(self, p: _Enc) -> np.ndarray:
        host = np.empty(p.n, dtype=np.uint8)
        if p.n:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, p.ptr, p.n, _D2H, self.save.stream.ptr)
            self.save.sync()
        return host.view(p.dtype).reshape(p.shape or (-1,))

    def _host_encode(self, p: _Enc) -> bytes:
        x = self._host_source(p)
        c = p.item.codec
        if c == "ans":  # no CPU ANS: too large for the workspace means exact raw storage
            return raw_segment(x, role=p.role, layer=p.layer, reason=RawReason.UNSUPPORTED)
        codec = get_codec(c, seed=self.seed) if c.startswith("turboquant") else c
        return encode_segment(x, codec, role=p.role, layer=p.layer)

    def _run_encode(self, plans: list[_Enc], job: EncodeJob, out_region: "Callable[[int], np.ndarray | None] | None",
                    align: int, device_sink: "Callable[[int, Any], None] | None" = None) -> _Flight:
        """Queue one encode batch (upload, kernels, download into ``out_region``) into the workspace beside
        the batch in flight; its host part runs when the flight is finished."""
        w = self.save
        for j, p in enumerate(plans):
            p.meta = j
        ans = sorted((p for p in plans if p.kind == "ans"), key=lambda p: p.ans_type)
        chunk = sum(p.nch for p in ans)
        off, total, rounds = self._enc_layout(plans, align, ans)
        off["align"] = align
        # The download: the region up to the ANS slots' packed end as the previous batches suggest (their
        # packed share of the worst case, plus a margin); _finish_encode fetches the rest should it be short.
        worst = off["region_end"] - off["meta"] - off["ans_slot0"]
        off["download"] = off["ans_slot0"] + min(worst, _up(int(worst * min(1.0, self._ans_packed + ANS_MARGIN)), align))
        base, upload = w.place(total)
        region = base + off["meta"]
        up = upload.get(off["pay_len"] + 8 * (len(ans) + 1))
        up[off["meta"]:] = 0
        chunk_cap = self._chunk_cap() if ans else 0
        cols = _enc_cols(plans)
        groups = _enc_groups(cols, np.fromiter((p.meta for p in ans), dtype=np.int64, count=len(ans)))
        rows = _encode_rows(up, off["desc"], cols, groups, region + HEADER_SIZE, self.seed, chunk_cap, base, off,
                            rounds)
        if ans:  # per chunk: source address, source bytes, output buffer (whole-batch numpy passes)
            a = up[off["chunk_in"]:off["chunk_in"] + 24 * chunk].view("<u8").reshape(3, chunk)
            cb = ans_format.CHUNK_BYTES
            nch = np.array([p.nch for p in ans], dtype=np.int64)
            at = _within(nch)
            a[0] = np.repeat(np.array([p.ptr for p in ans], dtype=np.int64), nch) + cb * at
            a[1] = np.minimum(cb, np.repeat(np.array([p.n for p in ans], dtype=np.int64), nch) - cb * at)
            a[2] = np.repeat(np.array([base + p.tmp for p in ans], dtype=np.int64), nch) + chunk_cap * at
        w.h2d(base, up)
        host, _ = self._launch_encode(base, off, rows, groups, len(plans), out_region, rounds, chunk,
                                      off["temp_len"], align)
        region_len = off["region_end"] - off["meta"]
        return w.launched(base, total, upload, lambda: self._finish_encode(plans, job, off, host, region, region_len,
                                                                            ans, device_sink), w.copies)

    def _launch_encode(self, base: int, off: dict[str, int], rows: dict[str, tuple[int, int]],
                       groups: Sequence[tuple[str, np.ndarray]], k: int,
                       out_region: "Callable[[int], np.ndarray | None] | None",
                       rounds: "_AnsRounds | None" = None, chunk: int = 0, temp: int = 0,
                       align: int = SLOT_ALIGN, heads: "tuple[int, int, int] | None" = None) -> tuple[np.ndarray, bool]:
        """Queue an encode batch's kernels (its descriptors are up): FP8 and TurboQuant encodes, per ANS round
        nvCOMP over its chunks then their placing and packing, the CRC32C pass; then the download of the output
        region (meta, ANS payload lengths, slots; up to ``off["download"]`` when given) on the copy stream,
        into ``out_region``'s array or a pinned one of the engine's. Answers that array, and whether it is
        the engine's."""
        w, kern = self.save, self._kernels
        counts = {name: len(sel) for name, sel in groups}
        segs = base + off["desc"]
        region = base + off["meta"]
        for name in ("okv_fp8_encode", "okv_tq_encode_k", "okv_tq_encode_v"):
            if name in rows:
                first, blocks = rows[name]
                table = kern.crc_tables if name == "okv_fp8_encode" else kern.tq_tables
                w.launch(kern, name, segs + first * km.SEG_DTYPE.itemsize, counts[name], blocks, region, table)
        if rounds is not None:  # each round: nvCOMP per type (type, first chunk, chunks), place, pack
            nv = self.nvcomp()
            col = base + off["chunk_in"]
            first, _ = rows["okv_ans_pack"]
            carry = base + off["pay_len"] + 8 * counts["okv_ans_pack"]
            w.stats["ans_rounds"] += len(rounds.rounds)
            for lo, hi, blocks, calls in rounds.rounds:
                for t, c0, cn in calls:
                    nv.compress(col + 8 * c0, col + 8 * (chunk + c0), ans_format.CHUNK_BYTES, cn,
                                base + off["temp"] if temp else 0, temp, col + 8 * (2 * chunk + c0),
                                base + off["chunk_sizes"] + 8 * c0, t, base + off["chunk_status"] + 4 * c0,
                                w.stream.ptr)
                    w.stats["launches"] += 1
                at = segs + (first + lo) * km.SEG_DTYPE.itemsize
                w.stats["launches"] += km.launch_ans_place(kern, at, hi - lo, region + off["ans_slot0"], align, carry,
                                                           w.stream)
                w.launch(kern, "okv_ans_pack", at, hi - lo, blocks, region, kern.crc_tables)
        if "okv_crc32c" in rows:
            first, blocks = rows["okv_crc32c"]
            w.launch(kern, "okv_crc32c", segs + first * km.SEG_DTYPE.itemsize, counts["okv_crc32c"], blocks, region,
                     kern.crc_tables)
        if heads is not None:
            w.write_headers(kern, heads[0], k, region, heads[1], heads[2])
        region_len = off["region_end"] - off["meta"]
        host = out_region(region_len) if out_region is not None else None
        own = host is None
        if own:
            host = _pinned_array(region_len)
        w.handoff(w.copies, w.stream)  # the download runs beside the next batch's kernels
        w.d2h(host[:off.get("download", region_len)], region, w.copies)
        w.stats["batches"] += 1
        w.stats["segments"] += k
        return host, own

    def _finish_encode(self, plans: list[_Enc], job: EncodeJob, off: dict[str, int], host: np.ndarray, region: int,
                       region_len: int, ans: list[_Enc],
                       device_sink: "Callable[[int, Any], None] | None") -> None:
        """The host part of an encode batch whose stream work has completed: statuses, CRC32Cs, headers. The
        headers are written from template rows (one per distinct field set), the header CRCs computed as
        an array; per-segment Python only for a segment that falls back to raw storage."""
        w, out = self.save, job.out
        k = len(plans)
        meta = host[:16 * k].view(km.META_DTYPE)
        status = meta["status"]
        heads = [p.head for p in plans]  # the classes' tuples: one template each, ANS's stored length aside
        walked = np.fromiter([h[3] for h in heads], dtype=np.int64, count=k)
        bad = status != 0
        if ans:  # the stored length of an ANS payload is what nvCOMP made of it
            a_off = off["pay_len"] - off["meta"]
            at = np.fromiter([p.meta for p in ans], dtype=np.int64, count=len(ans))
            size = host[a_off:a_off + 8 * len(ans)].view("<u8").astype(np.int64)
            # over the class's capacity (keep_capacity) is exactly what worth_keeping refuses
            bad[at] |= (size == 0) | (size > walked[at])
            walked[at] = size
            for p, slot in zip(ans, self._packed_slots(size, off, host, region).tolist()):
                p.slot = slot
        crcs = finish_crc(meta["acc"], walked)
        keep = np.ones(k, dtype=bool)
        for j in np.flatnonzero(bad).tolist():
            p = plans[j]
            if p.kind == "ans":
                reason = RawReason.UNSUPPORTED if status[j] & km.ST_ANS_FAILED else RawReason.NOT_SMALLER
            elif p.kind in ("fp8", "tq"):
                reason = RawReason.NONFINITE if status[j] & km.ST_NONFINITE else RawReason.OUT_OF_RANGE
            else:
                continue
            keep[j] = False
            w.stats["raw_fallbacks"] += 1
            out[p.i] = raw_segment(self._host_source(p), role=p.role, layer=p.layer, reason=reason)
        good = np.flatnonzero(keep)
        if not good.size:
            return
        tids, rows, bases = self._template_ids([heads[j] for j in good.tolist()] if len(good) < k else heads)
        slots = np.fromiter(map(attrgetter("slot"), plans), dtype=np.int64, count=k)[good]
        idx = np.fromiter([p.i for p in plans], dtype=np.int64, count=k)[good]
        length = _write_headers(job, host, rows, bases, tids, crcs[good], slots, idx, views=True,
                                stored=walked[good] if ans else None)
        if device_sink is not None:
            self._sink_device([(plans[j], n) for j, n in zip(good.tolist(), length.tolist())], host, region,
                              region_len, device_sink)

    def _packed_slots(self, size: np.ndarray, off: dict[str, int], host: np.ndarray, region: int) -> np.ndarray:
        """The ANS slots as ``okv_ans_place`` packed them (from the payload lengths ``size``, in packing order; a
        zero length takes no room); and the bytes past the download, when the packed slots end beyond it,
        fetched now (one synchronous copy). The next batch's download follows this batch's packed share of
        the worst case."""
        align = off["align"]
        steps = np.where(size > 0, -(-(HEADER_SIZE + size) // align) * align, 0)
        slots = off["ans_slot0"] + np.cumsum(steps) - steps
        end, got = off["ans_slot0"] + int(steps.sum()), off["download"]
        worst = off["region_end"] - off["meta"] - off["ans_slot0"]
        self._ans_packed = (end - off["ans_slot0"]) / worst if worst else 1.0
        if end > got:
            self.save.fetch(host.ctypes.data + got, region + got, end - got)
            self.save.stats["ans_tail_fetches"] += 1
        return slots

    def _template_ids(self, heads: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For header field tuples (``_Enc.head``'s ints, payload CRC aside): each one's row in the templates
        answered (a (templates, 64) uint8 array of headers with a zero payload CRC) and their 60-byte
        CRC32Cs. Validates each distinct tuple once (raises as :func:`~orbitkv_fs.segment.pack_header`)."""
        known = self._rows
        # Grouped by identity first: a batch's plans share their class's tuple (hashing one, with its enums,
        # costs more than the rest of a segment's header); equal tuples apart just repeat a row.
        by_id: dict[int, int] = {}
        order: list[tuple] = []
        tids = []
        for h in heads:
            t = by_id.get(id(h))
            if t is None:
                t = by_id[id(h)] = len(order)
                order.append(h)
            tids.append(t)
        for h in order:
            if h not in known:
                fmt, dtype, orig, stored, role, layer, bits, head_dim, sign_version, seed, ans_type, reason = h
                if len(known) >= 4096:
                    known.clear()
                row, crc = header_row(SegmentHeader(Format(fmt), dtype_from_code(dtype), orig, stored, 0,
                                                    role=Role(role), layer=layer, bits=bits, head_dim=head_dim,
                                                    sign_version=sign_version, rotation_seed=seed,
                                                    ans_type=AnsType(ans_type), raw_reason=RawReason(reason)))
                known[h] = (row.tobytes(), crc)
        made = [known[h] for h in order]
        rows = np.frombuffer(b"".join([m[0] for m in made]), dtype=np.uint8).reshape(-1, HEADER_SIZE)
        bases = np.fromiter([m[1] for m in made], dtype=np.uint32, count=len(made))
        return np.asarray(tids, dtype=np.intp), rows, bases

    def _sink_device(self, sunk: "list[tuple[_Enc, int]]", host: np.ndarray, region: int, region_len: int,
                     sink: "Callable[[int, Any], None]") -> None:
        """Hand the GPU-encoded segments of a finished batch to ``sink`` as device views: the headers
        (built on the host) go up into their slots first, on the worker's stream, which is then drained."""
        w = self.save
        for p, _ in sunk:
            cp.cuda.runtime.memcpyAsync(region + p.slot, host.ctypes.data + p.slot, HEADER_SIZE, _H2D, w.stream.ptr)
            w.stats["h2d_copies"] += 1
        w.stream.synchronize()  # the header copies (the download that preceded them is complete)
        w.stats["syncs"] += 1
        mem = cp.cuda.UnownedMemory(region, region_len, self)
        for p, n in sunk:
            sink(p.i, cp.ndarray((n,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, p.slot)))

    # -- decode --------------------------------------------------------------------------------
    def _device_heads(self, segments: Sequence[Any]) -> "dict[int, tuple[bytes, bytes]]":
        """For the segments handed in device memory: their 64-byte header and, for ANS, the payload's chunk
        table, copied to the host (two rounds of small copies and one synchronisation each; the payloads
        stay where they are). Segments too short for a header get empty bytes (``_dec_plan`` rejects them)."""
        dev = [i for i, s in enumerate(segments) if isinstance(s, cp.ndarray)]
        if not dev:
            return {}
        w = self.restore
        heads: dict[int, tuple[bytes, bytes]] = {}

        def fetch(want: "dict[int, tuple[int, int]]") -> dict[int, bytes]:
            total = sum(n for _, n in want.values())
            host = _pinned_array(total)
            pos, where = 0, {}
            for i, (ptr, n) in want.items():
                cp.cuda.runtime.memcpyAsync(host.ctypes.data + pos, ptr, n, _D2H, w.stream.ptr)
                w.stats["d2h_copies"] += 1
                where[i] = (pos, n)
                pos += n
            w.sync()
            return {i: host[a:a + n].tobytes() for i, (a, n) in where.items()}

        ok = {i: (int(segments[i].data.ptr), HEADER_SIZE) for i in dev
              if segments[i].dtype == cp.uint8 and segments[i].ndim == 1 and segments[i].flags.c_contiguous
              and segments[i].nbytes >= HEADER_SIZE}
        got = fetch(ok) if ok else {}
        tables: dict[int, tuple[int, int]] = {}
        for i in dev:
            hb = got.get(i, b"")
            heads[i] = (hb, b"")
            try:
                h = parse_header(hb) if hb else None
            except SegmentError:
                continue
            if h is not None and h.format == Format.ANS and segments[i].nbytes >= HEADER_SIZE + h.stored_length:
                n = min(h.stored_length, ans_format.data_start(ans_format.chunk_count(h.original_length)))
                if n:
                    tables[i] = (int(segments[i].data.ptr) + HEADER_SIZE, n)
        for i, t in (fetch(tables) if tables else {}).items():
            heads[i] = (heads[i][0], t)
        return heads

    def _dec_plan(self, i: int, seg: Any, dst: Any, head: "tuple[bytes, bytes] | None" = None,
                  h: "SegmentHeader | None" = None) -> "_Dec | OrbitKVError":
        if head is not None:
            return self._dec_plan_device(i, seg, dst, head)
        try:
            # The Manager's arena views are byte memoryviews already: no cast (a new view) per segment.
            mv = (seg if type(seg) is memoryview and seg.format == "B" and seg.ndim == 1 and seg.c_contiguous
                  else memoryview(seg).cast("B"))
            h = h or parse_header(mv)
            if len(mv) < HEADER_SIZE + h.stored_length:
                raise TruncatedSegment(f"payload needs {h.stored_length} bytes, {len(mv) - HEADER_SIZE} present")
        except SegmentError as e:
            return e
        except TypeError as e:
            return SegmentError(f"segment {i} is not a bytes-like object: {e}")
        dst = _dec_target(i, dst, h)
        if isinstance(dst, OrbitKVError):
            return dst
        kind = _DEC_KINDS[h.format]
        p = _Dec(i, h, mv[HEADER_SIZE:HEADER_SIZE + h.stored_length], dst, kind)
        if kind == "ans":
            try:
                p.offsets, p.sizes = ans_format.parse(p.payload, h.original_length)
            except SegmentError as e:
                return e
        return p

    def _dec_plan_device(self, i: int, seg: Any, dst: Any, head: "tuple[bytes, bytes]") -> "_Dec | OrbitKVError":
        """``_dec_plan`` of a segment in device memory (``head``: its header and ANS chunk table, from
        :meth:`_device_heads`). The payload is used where it lies when 8-byte aligned (nvCOMP's input
        alignment), else copied device to device into the batch's staging area; never through the host."""
        hb, table = head
        try:
            if seg.dtype != cp.uint8 or seg.ndim != 1 or not seg.flags.c_contiguous:
                raise SegmentError(f"device segment {i} must be a 1-D C-contiguous cupy uint8 array")
            h = parse_header(hb)
            if int(seg.nbytes) < HEADER_SIZE + h.stored_length:
                raise TruncatedSegment(f"payload needs {h.stored_length} bytes, {int(seg.nbytes) - HEADER_SIZE} present")
        except SegmentError as e:
            return e
        dst = _dec_target(i, dst, h)
        if isinstance(dst, OrbitKVError):
            return dst
        kind = _DEC_KINDS[h.format]
        dev = int(seg.data.ptr) + HEADER_SIZE
        p = _Dec(i, h, None, dst, kind, dev=dev, inplace=dev % 8 == 0)  # type: ignore[arg-type]
        if kind == "ans":
            try:
                p.offsets, p.sizes = ans_format.parse_table(table, h.stored_length, h.original_length)
            except SegmentError as e:
                return e
        return p

    def _dec_layout(self, plans: Sequence[_Dec], hosts: "dict[int, int]") -> tuple[dict[str, int], int]:
        """Offsets of one decode batch; (offsets, total workspace bytes). Payloads uploaded
        from pinned host memory (``hosts``: segment index -> payload address) that lie one after another
        there, as a save batch leaves them in the arena, are staged at the same relative offsets, so that
        a run of them goes up in one copy."""
        ans = [p for p in plans if p.kind == "ans"]
        lay, off = _dec_layout_fixed(len(plans), sum(int(p.sizes.size) for p in ans))
        prev: "tuple[_Dec, int] | None" = None  # the last staged pinned payload and its host address
        for p in plans:
            if p.inplace:  # a device payload read in place needs no staging
                continue
            a = hosts.get(p.i)
            if (a is not None and prev is not None and (a - prev[1]) % SLOT_ALIGN == 0
                    and 0 <= a - prev[1] - prev[0].h.stored_length <= _MIRROR_GAP):
                p.staged = prev[0].staged + (a - prev[1])
                lay.end = p.staged + p.h.stored_length
            else:
                p.staged = lay.take(p.h.stored_length)
            prev = (p, a) if a is not None else None
        for p in ans:
            p.scratch = lay.take(p.h.original_length)
        fill = _Fill()
        for p in ans:
            fill = fill.add(self._dec_fill(p))
        temp = self._dec_temp(fill)
        off["temp"] = lay.take(temp)
        off["temp_bytes"] = temp
        return off, lay.end

    def _dec_temp(self, fill: _Fill) -> int:
        """nvCOMP's decompression temp bytes for a batch's ANS segments (the largest over their data types)."""
        if not fill.ans:
            return 0
        nv = self.nvcomp()
        return max(nv.decompress_temp_bytes(fill.chunks, ans_format.CHUNK_BYTES, fill.ans_bytes, t) for t in fill.types)

    def _dec_estimate(self, fill: _Fill) -> int:
        """Upper bound of :meth:`_dec_layout` 's total for a batch of these totals (``fill.bytes``: staging)."""
        k = fill.k
        fixed = _up(2 * k * km.SEG_DTYPE.itemsize) + _up(16 * k) + _up(44 * max(fill.chunks, 1)) + 4 * 256
        return fixed + fill.bytes + self._dec_temp(fill)

    @staticmethod
    def _dec_fill(p: _Dec) -> _Fill:
        """A batch of the one segment ``p``: its staging (payload, mirror gap, ANS scratch) and ANS chunks."""
        staged = _dec_staging(p)
        if p.kind != "ans":
            return _Fill.of(staged)
        return _Fill.of(staged + _up(p.h.original_length), int(p.sizes.size), p.h.original_length, p.h.ans_type)

    def decode_batch(self, segments: Sequence[Any], destinations: Sequence[Any], *,
                     pinned: "Sequence[bool] | None" = None) -> "list[OrbitKVError | None]":
        """Verify and decode ``segments`` into ``destinations`` (cupy arrays of the original byte size).

        Returns one entry per segment: None when the destination now holds the decoded values, or the
        error (header, length, CRC32C, nvCOMP status) that made it a miss -- its destination is then left
        as it was. Never raises for bad segment bytes. ``pinned[i]`` says segment i lies in pinned host
        memory (the Manager's arena): its payload is then copied to the device from where it is, one copy
        per segment, instead of through the upload buffer.

        A segment may also be a 1-D cupy uint8 array in device memory (header + payload, e.g. a record
        the SSD tier read with cuFile): its header (and an ANS chunk table) comes to the host in one small
        copy, its payload is CRC-checked and decoded on the device where it lies, with no host bounce.

        Same as :meth:`decode_collect` of :meth:`decode_submit`.
        """
        return self.decode_collect(self.decode_submit(segments, destinations, pinned=pinned))

    def decode_submit(self, segments: Sequence[Any], destinations: Sequence[Any], *,
                      pinned: "Sequence[bool] | None" = None,
                      headers: "Sequence[SegmentHeader | None] | None" = None) -> DecodeJob:
        """Start decoding (arguments as :meth:`decode_batch`): the GPU batches are queued and the last one
        is left running, so that the caller can submit its next batch before :meth:`decode_collect` waits
        for this one. Segments (host bytes) and destinations must stay untouched until then.
        ``headers[i]``, when given, is host segment i's header as the caller already parsed it (the payload
        CRC32C is still checked here)."""
        if len(segments) != len(destinations):
            raise CodecError(f"{len(segments)} segments but {len(destinations)} destinations")
        job = DecodeJob([None] * len(segments))
        results = job.results
        w = self.restore
        with w.lock:
            w.wait_for_current()
            try:
                gpu: list[_Dec] = []
                fill = _Fill()
                half = self.budget_bytes // 2
                heads = self._device_heads(segments)
                plans: list[_Dec] = []
                for i, (seg, dst) in enumerate(zip(segments, destinations)):
                    p = self._dec_plan(i, seg, dst, heads.get(i), headers[i] if headers is not None else None)
                    if isinstance(p, OrbitKVError):
                        results[i] = p
                    else:
                        plans.append(p)
                plain = self._plain_dec_batches(plans)
                if plain is not None:
                    for batch in plain:
                        job.flights.append(self._run_decode(batch, results, pinned))
                    return job
                for p in plans:
                    i = p.i
                    one = self._dec_fill(p) if p.kind == "ans" else None
                    more = fill.add(one) if one is not None else fill.plus(_dec_staging(p))
                    if len(gpu) < MAX_BATCH and self._dec_estimate(more) <= half:
                        gpu.append(p)  # (then it alone fits too)
                        fill = more
                        continue
                    one = one or self._dec_fill(p)
                    if self._dec_estimate(one) > self.budget_bytes:
                        results[i] = self._host_decode(p)
                        continue
                    if gpu:
                        job.flights.append(self._run_decode(gpu, results, pinned))
                    gpu, fill = [p], one
                if gpu:
                    job.flights.append(self._run_decode(gpu, results, pinned))
            except BaseException:  # nothing of this call may run on into buffers the caller reclaims
                w.drop(job.flights)
                raise
        return job

    def decode_columns_submit(self, heads: np.ndarray, src: np.ndarray, dst: np.ndarray, dst_bytes: np.ndarray, *,
                              within: "np.ndarray | None" = None, in_place: bool = False) -> "DecodeJob | None":
        """:meth:`decode_submit` of segments given as arrays, with no Python per segment: ``heads``
        (``[n, 64]`` uint8) their headers, verified by the caller (only the payload CRC32C is checked here),
        ``src`` the host address of each payload (the byte after its header) in pinned memory, ``dst`` the
        device address of each destination and ``dst_bytes`` its size (a destination of another size than
        the header's source length is a :class:`LengthMismatch`, left untouched). ANS payloads must lie in
        ``within`` (a uint8 array, the caller's pinned pool): their chunk tables are parsed from it in one
        pass (:func:`~orbitkv_fs.gpu.ans_format.parse_tables`; a table that does not parse is that segment's
        error). ``in_place``: nvCOMP decompresses ANS payloads straight into their destinations, so that an ANS
        segment takes only its payload's room in the workspace and needs no checked copy; a segment that then
        fails (its CRC32C, nvCOMP's status or its length) may leave its destination written, within its
        ``dst_bytes``: for destinations that are the caller's scratch, read only where a segment passed (the
        Manager's restore temporary). Without it a failed segment's destination is untouched, as for every
        other format. Payloads and destinations must stay untouched until :meth:`decode_collect`. Answers None,
        queueing nothing, when a segment is ANS and ``within`` is not given, or a segment needs more than half
        the workspace alone: :meth:`decode_submit` takes those."""
        h = np.ascontiguousarray(heads, dtype=np.uint8).view(HEADER_DTYPE).reshape(-1)
        n = len(h)
        fmt = h["format"]
        ans = fmt == Format.ANS
        if not _GPU_FORMATS[fmt].all() or (ans.any() and within is None):
            return None
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        stored, orig = h["stored_length"].astype(np.int64), h["original_length"].astype(np.int64)
        job = DecodeJob([None] * n)
        wrong = np.asarray(dst_bytes, dtype=np.int64) != orig
        for i in np.flatnonzero(wrong).tolist():
            job.results[i] = LengthMismatch(f"destination {i} holds {int(dst_bytes[i])} bytes; the segment "
                                            f"decodes to {int(orig[i])}")
        tables = None
        limit = self.budget_bytes // 2
        # Without ANS or wrong destinations, the flights and their plans are kept by the headers but for CRCs.
        key = (fixed_words(np.ascontiguousarray(heads, dtype=np.uint8)).tobytes()
               if not ans.any() and not wrong.any() else None)
        memo = self._dec_plans.get(key) if key is not None else None
        # what a payload's staging counts (a memo's cut counted it already)
        sizes = -(-stored // SLOT_ALIGN) * SLOT_ALIGN + _MIRROR_GAP if memo is None else None
        if memo is not None:
            batches = memo[0]
        elif ans.any():
            at = np.flatnonzero(ans)
            tables = ans_format.parse_tables(within, src[at] - within.ctypes.data, stored[at], orig[at])
            for j in np.flatnonzero(tables.err).tolist():
                i = int(at[j])
                if not wrong[i]:
                    job.results[i] = ans_format.table_error(tables, j, int(stored[i]), int(orig[i]))
                wrong[i] = True
            # ... and its scratch (the decompressed bytes) and chunk arrays; and each batch nvCOMP's temp
            nch = np.zeros(n, dtype=np.int64)
            nch[at] = tables.nch
            sizes[at] += 44 * tables.nch if in_place else -(-orig[at] // SLOT_ALIGN) * SLOT_ALIGN + 44 * tables.nch
            atype = h["ans_type"].astype(np.int64)

            def temp_of(b: np.ndarray) -> int:
                b = b[ans[b]]
                return self._dec_temp_of(atype[b], nch[b], orig[b]) if len(b) else 0
            batches = _temp_batches(sizes, _dec_fixed, limit, temp_of)
        else:
            batches = _prefix_batches(np.arange(n), sizes, _dec_fixed, limit, even=True)
            if key is not None and batches is not None:
                batches = [_frozen(b) for b in batches]
                memo = _remember(self._dec_plans, key, (batches, [None] * len(batches)))
        if batches is None:
            return None
        w = self.restore
        with w.lock:
            w.wait_for_current()
            try:
                for b, rows in enumerate(batches):
                    if wrong.any():
                        rows = rows[~wrong[rows]]
                    if not len(rows):
                        continue
                    # a batch's rows are consecutive but where wrong ones left it: views of the columns then
                    at = rows if wrong.any() else slice(int(rows[0]), int(rows[-1]) + 1)
                    if memo is not None and memo[1][b] is not None:
                        flight = self._run_planned_decode(memo[1][b], h[at], src[at], dst[at], rows, job.results)
                    else:
                        flight = self._run_decode_columns(h[at], src[at], dst[at], rows, job.results, tables,
                                                          ans, plans=memo[1] if memo is not None else None, at=b,
                                                          in_place=in_place)
                    job.flights.append(flight)
            except BaseException:  # nothing of this call may run on into buffers the caller reclaims
                w.drop(job.flights)
                raise
        return job

    def _dec_temp_of(self, types: np.ndarray, nch: np.ndarray, orig: np.ndarray) -> int:
        """nvCOMP's decompression temp bytes for ANS segments of these types, chunk counts and original lengths:
        as :meth:`_dec_temp`, the largest over their types of the temp for all their chunks."""
        chunks, total = int(nch.sum()), int(orig.sum())
        return max(self.nvcomp().decompress_temp_bytes(chunks, ans_format.CHUNK_BYTES, total, AnsType(t))
                   for t in np.unique(types).tolist())

    def _run_decode_columns(self, h: np.ndarray, host: np.ndarray, dst: np.ndarray, rows: np.ndarray,
                            results: list, tables: "ans_format.Tables | None" = None,
                            is_ans: "np.ndarray | None" = None, *, plans: "list | None" = None,
                            at: int = 0, in_place: bool = False) -> _Flight:
        """Queue one decode batch of :meth:`decode_columns_submit` (``rows``: its segments' indices there):
        the descriptors (and ANS chunk arrays) up, each run of neighbouring payloads up in one copy from where
        it lies, the kernels and nvCOMP; its verdicts are made when the flight is finished. ``tables``: the
        request's ANS chunk tables, row ``j`` of them the request's ``j``-th ANS segment (``is_ans``).
        ``plans``: where this flight's :class:`_DecPlan` goes (``plans[at]``), made from what is sent here
        when it has no ANS segment. ``in_place``: nvCOMP writes the ANS segments' destinations (as there)."""
        w = self.restore
        k = len(h)
        stored, orig = h["stored_length"].astype(np.int64), h["original_length"].astype(np.int64)
        a = np.flatnonzero(h["format"] == Format.ANS)
        chunks, calls = 0, []
        if len(a):  # one nvCOMP call per ANS type: each type's chunks together, in batch order within it
            a = a[np.argsort(h["ans_type"][a], kind="stable")]
            t_of = np.cumsum(is_ans)[rows[a]] - 1  # each one's row in the tables
            nch = tables.nch[t_of]
            chunks = int(nch.sum())
            c0 = np.cumsum(nch) - nch
            types = h["ans_type"][a].astype(np.int64)
            for t in np.unique(types).tolist():
                sel = np.flatnonzero(types == t)
                calls.append((AnsType(t), int(c0[sel[0]]), int(nch[sel].sum())))
        lay, off = _dec_layout_fixed(k, chunks)
        staged, runs = _mirror(host, stored, lay)
        scratch = np.zeros(k, dtype=np.int64)
        if len(a):
            if not in_place:  # the decompressed bytes, which the checked copy moves once their checks pass
                step = -(-orig[a] // SLOT_ALIGN) * SLOT_ALIGN
                scratch[a] = lay.take(0) + np.cumsum(step) - step
                lay.end = int(scratch[a[-1]] + step[-1])
            temp = self._dec_temp_of(types, nch, orig[a])
            off["temp"], off["temp_bytes"] = lay.take(temp), temp
        total = lay.end
        base, upload = w.place(total)
        up = upload.get(off["down_end"])
        up[off["meta"]:] = 0
        cols = _header_cols(h, base + staged, dst)
        if len(a):
            if not in_place:
                chunk0 = np.zeros(k, dtype=np.int64)
                chunk0[a] = c0
                cols = cols._replace(scratch=np.where(scratch > 0, base + scratch, 0), chunk0=chunk0)
            # per chunk: payload address, compressed bytes, decoded bytes, where nvCOMP writes them
            at = _within(nch)
            idx = np.repeat(tables.chunk0[t_of], nch) + at
            cb = ans_format.CHUNK_BYTES
            arr = up[off["chunk_in"]:off["chunk_in"] + 32 * chunks].view("<u8").reshape(4, chunks)
            arr[0] = np.repeat(base + staged[a], nch) + tables.offsets[idx]
            arr[1] = tables.sizes[idx]
            arr[2] = np.minimum(cb, np.repeat(orig[a], nch) - cb * at)
            arr[3] = np.repeat(dst[a] if in_place else base + scratch[a], nch) + cb * at
        firsts = _decode_rows(up, off["desc"], cols, base + off["chunk_actual"], base + off["chunk_status"],
                              ans_copied=not in_place)
        if plans is not None and not len(a):
            n_rows = sum(r[1] for r in firsts.values())
            desc = up[off["desc"]:off["desc"] + n_rows * km.SEG_DTYPE.itemsize].view(np.uint64).reshape(n_rows, -1)
            plans[at] = _DecPlan(off, firsts, _frozen(desc.copy()), k, _frozen(stored),
                                 _frozen(zero_crc(stored).astype(np.int64)))
        meta = self._send_decode(base, off, up, firsts, host, staged, stored, runs, k, calls, chunks)

        def finish() -> None:
            bad = _crc_verdicts(meta, cols.expect, rows, results)
            if not len(a):
                return
            a_off, s_off = off["chunk_actual"] - off["meta"], off["chunk_status"] - off["meta"]
            actual = meta[a_off:a_off + 8 * chunks].view("<u8")
            status = meta[s_off:s_off + 4 * chunks].view("<i4")
            got = np.add.reduceat(actual, c0)
            failed = np.logical_or.reduceat(status != 0, c0)
            for j in np.flatnonzero((failed | (got != orig[a])) & ~bad[a]).tolist():
                i = int(rows[a[j]])
                if failed[j]:
                    sl = status[c0[j]:c0[j] + nch[j]]
                    results[i] = SegmentError(f"segment {i}: nvCOMP ANS decompression failed "
                                              f"({self.nvcomp().status_name(int(sl[np.flatnonzero(sl)[0]]))})")
                else:
                    results[i] = LengthMismatch(f"segment {i}: ANS decompressed {int(got[j])} bytes, "
                                                f"header says {int(orig[a[j]])}")

        return w.launched(base, total, upload, finish)

    def _run_planned_decode(self, plan: _DecPlan, h: np.ndarray, host: np.ndarray, dst: np.ndarray, rows: np.ndarray,
                            results: list) -> _Flight:
        """:meth:`_run_decode_columns` of a flight whose :class:`_DecPlan` is known: only the staging of its
        payloads (from where they lie), the addresses and expected CRCs of its descriptor rows are made here."""
        w, off = self.restore, plan.off
        lay = _Layout()
        lay.end = off["down_end"]
        staged, runs = _mirror(host, plan.stored, lay)
        base, upload = w.place(lay.end)
        up = upload.get(off["down_end"])
        up[off["meta"]:] = 0
        expect = h["payload_crc"].astype(np.int64) ^ plan.zero
        desc = up[off["desc"]:off["desc"] + plan.rows.nbytes].view(np.uint64).reshape(plan.rows.shape)
        rows_.decode_addresses(desc, desc.view(np.uint32), plan.rows, plan.check, base + staged, dst, expect)
        meta = self._send_decode(base, off, up, plan.firsts, host, staged, plan.stored, runs, len(h))
        return w.launched(base, lay.end, upload, lambda: _crc_verdicts(meta, expect, rows, results))

    def _send_decode(self, base: int, off: dict, up: np.ndarray, firsts: dict, host: np.ndarray, staged: np.ndarray,
                     stored: np.ndarray, runs: list, k: int, calls: Sequence = (), chunks: int = 0) -> np.ndarray:
        """Send a decode flight whose upload ``up`` is written: it goes up on the copy stream, each run of
        payloads from where it lies, then its kernels (:meth:`_launch_decode`); answers the meta download."""
        w = self.restore
        cs = w.copies
        w.h2d(base, up, cs)
        for r0, r1 in runs:
            w.h2d_raw(base + int(staged[r0]), int(host[r0]), int(staged[r1 - 1] + stored[r1 - 1] - staged[r0]), cs)
        w.handoff(w.stream, cs)
        return self._launch_decode(base, off, firsts, k, calls, chunks)

    def _plain_dec_batches(self, plans: list[_Dec]) -> "list[list[_Dec]] | None":
        """The GPU batches of ``plans`` when none is ANS and each fits half the workspace alone: those the
        per-segment fit check of :meth:`decode_submit` would form, found with one cumulative sum; else None."""
        if any(p.kind == "ans" for p in plans):
            return None
        return self._dec_cuts(plans, np.fromiter([p.h.stored_length for p in plans], np.int64, count=len(plans)))

    def _dec_cuts(self, items: Sequence, stored: np.ndarray) -> "list | None":
        """``items`` (none ANS) cut into GPU batches by their payloads' ``stored`` bytes, each counted as
        :func:`_dec_staging` counts it: :func:`_prefix_batches` against half the workspace, evened out."""
        return _prefix_batches(items, -(-stored // SLOT_ALIGN) * SLOT_ALIGN + _MIRROR_GAP, _dec_fixed,
                               self.budget_bytes // 2, even=True)

    def decode_collect(self, job: DecodeJob) -> "list[OrbitKVError | None]":
        """Wait for a submitted decode; its per-segment errors (as :meth:`decode_batch`)."""
        w = self.restore
        with w.lock:
            for f in job.flights:
                w.finish(f)
        return job.results

    def _host_decode(self, p: _Dec) -> "OrbitKVError | None":
        from orbitkv_fs.segment import crc32c

        w = self.restore
        w.stats["cpu_fallbacks"] += 1
        if p.payload is None:  # a device segment over the workspace budget: its payload comes down
            host = np.empty(p.h.stored_length, dtype=np.uint8)
            if host.nbytes:
                cp.cuda.runtime.memcpyAsync(host.ctypes.data, p.dev, host.nbytes, _D2H, w.stream.ptr)
                w.sync()
            p.payload = memoryview(host)
        try:
            if crc32c(p.payload) != p.h.payload_crc:
                raise PayloadChecksumMismatch("payload CRC32C mismatch")
            x = np.ascontiguousarray(decode_payload(p.h, p.payload)).view(np.uint8)
        except OrbitKVError as e:
            return e
        if x.nbytes != p.h.original_length:
            return LengthMismatch(f"decoded {x.nbytes} bytes, expected {p.h.original_length}")
        if x.nbytes:
            cp.cuda.runtime.memcpyAsync(p.dst.ptr, x.ctypes.data, x.nbytes, _H2D, w.stream.ptr)
            w.sync()
        return None

    def _run_decode(self, plans: list[_Dec], results: list, pinned: "Sequence[bool] | None") -> _Flight:
        """Queue one decode batch (upload, CRC32C, decode kernels, status download) into the workspace
        beside the batch in flight; its verdicts are made when the flight is finished."""
        w = self.restore
        for j, p in enumerate(plans):
            p.meta = j
        ans = sorted((p for p in plans if p.kind == "ans"), key=lambda p: p.h.ans_type)
        chunks = 0
        for j, p in enumerate(ans):
            p.ans_index, p.chunk0 = j, chunks
            chunks += int(p.sizes.size)
        direct = {p.i for p in plans if pinned is not None and pinned[p.i] and not p.dev}
        hosts = {p.i: host_address(p.payload) for p in plans if p.i in direct}
        off, total = self._dec_layout(plans, hosts)
        base, upload = w.place(total)
        # The pinned upload buffer holds the descriptors and the payloads staged through it, not those
        # that go up from where they lie (pinned) or are on the device already.
        staged = [p for p in plans if p.i not in direct and not p.dev]
        up = upload.get(max([off["down_end"]] + [p.staged + p.h.stored_length for p in staged]))
        up[off["meta"]:off["down_end"]] = 0
        for p in staged:
            up[p.staged:p.staged + p.h.stored_length] = np.frombuffer(p.payload, np.uint8)

        def src(p: _Dec) -> int:  # where the kernels read the payload
            return p.dev if p.inplace else base + p.staged
        cols = _plan_cols(plans, np.fromiter(map(src, plans), dtype=np.int64, count=len(plans)), base)
        firsts = _decode_rows(up, off["desc"], cols, base + off["chunk_actual"], base + off["chunk_status"])
        if ans:  # per chunk: payload address, compressed bytes, decoded bytes, scratch address
            cb = ans_format.CHUNK_BYTES
            a = up[off["chunk_in"]:off["chunk_in"] + 32 * chunks].view("<u8").reshape(4, chunks)
            nch = np.array([p.sizes.size for p in ans], dtype=np.int64)
            at = _within(nch)
            a[0] = np.repeat(np.array([src(p) for p in ans], dtype=np.int64), nch) + np.concatenate([p.offsets for p in ans])
            a[1] = np.concatenate([p.sizes for p in ans])
            a[2] = np.minimum(cb, np.repeat(np.array([p.h.original_length for p in ans], dtype=np.int64), nch) - cb * at)
            a[3] = np.repeat(np.array([base + p.scratch for p in ans], dtype=np.int64), nch) + cb * at
        # The upload runs on the copy stream, beside the previous batch's kernels; this batch's kernels
        # wait for it.
        cs = w.copies
        if direct:  # descriptors, then the payloads from where they lie (the rest through the upload buffer)
            w.h2d(base, up[:off["down_end"]], cs)
            run: "tuple[int, int, int] | None" = None  # (staged offset, host address, bytes) of pinned payloads
            for p in plans:
                if p.dev:
                    continue
                if p.i not in direct:
                    w.h2d(base + p.staged, up[p.staged:p.staged + p.h.stored_length], cs)
                    continue
                a = hosts[p.i]
                if run is not None and p.staged - run[0] == a - run[1]:  # mirrored: extends the run
                    run = (run[0], run[1], p.staged + p.h.stored_length - run[0])
                    continue
                if run is not None:
                    w.h2d_raw(base + run[0], run[1], run[2], cs)
                run = (p.staged, a, p.h.stored_length)
            if run is not None:
                w.h2d_raw(base + run[0], run[1], run[2], cs)
        else:
            w.h2d(base, up, cs)
        w.handoff(w.stream, cs)
        for p in plans:  # device payloads the kernels cannot read in place: one device-to-device copy
            if p.dev and not p.inplace and p.h.stored_length:
                cp.cuda.runtime.memcpyAsync(base + p.staged, p.dev, p.h.stored_length, _D2D, w.stream.ptr)
        calls = [(t, min(p.chunk0 for p in ans if p.h.ans_type == t),
                  sum(int(p.sizes.size) for p in ans if p.h.ans_type == t)) for t in sorted({p.h.ans_type for p in ans})]
        host = self._launch_decode(base, off, firsts, len(plans), calls, chunks)
        return w.launched(base, total, upload,
                          lambda: self._finish_decode(plans, results, off, host, cols.expect, chunks))

    def _launch_decode(self, base: int, off: dict[str, int], firsts: dict[str, tuple[int, int, int]], k: int,
                       calls: "Sequence[tuple[int, int, int]]" = (), chunks: int = 0) -> np.ndarray:
        """Queue a decode batch's kernels on the restore stream (its descriptors and payloads are up): the
        CRC32C check, the FP8 and TurboQuant decodes, nvCOMP for the ANS chunks (``calls``: an (ANS type,
        first chunk, chunks) per nvCOMP call, their chunk arrays at ``chunk_in``), the checked copies; then
        the download of the meta and chunk statuses into the pinned array answered."""
        w, kern = self.restore, self._kernels
        meta_ptr = base + off["meta"]
        segs = base + off["desc"]
        size = km.SEG_DTYPE.itemsize
        first, count, blocks = firsts["okv_crc32c"]
        w.launch(kern, "okv_crc32c", segs + first * size, count, blocks, meta_ptr, kern.crc_tables)
        for name, table in (("okv_fp8_decode", None), ("okv_tq_decode", kern.tq_tables)):
            first, count, blocks = firsts[name]
            if count:
                w.launch(kern, name, segs + first * size, count, blocks, meta_ptr, table)
        if calls:
            nv, temp, col = self.nvcomp(), off["temp_bytes"], base + off["chunk_in"]
            for t, c0, cn in calls:
                nv.decompress(col + 8 * c0, col + 8 * (chunks + c0), col + 8 * (2 * chunks + c0),
                              base + off["chunk_actual"] + 8 * c0, cn, base + off["temp"] if temp else 0, temp,
                              col + 8 * (3 * chunks + c0), t, base + off["chunk_status"] + 4 * c0, w.stream.ptr)
                w.stats["launches"] += 1
        first, count, blocks = firsts["okv_copy_checked"]
        if count:
            w.launch(kern, "okv_copy_checked", segs + first * size, count, blocks, meta_ptr)
        host = _pinned_array(off["down_end"] - off["meta"])
        w.d2h(host, meta_ptr)
        w.stats["batches"] += 1
        w.stats["segments"] += k
        return host

    def _finish_decode(self, plans: list[_Dec], results: list, off: dict[str, int], host: np.ndarray,
                       expect: np.ndarray, chunks: int) -> None:
        """The host part of a decode batch whose stream work has completed: a verdict per segment."""
        meta = host[:16 * len(plans)].view(km.META_DTYPE)
        a_off, s_off = off["chunk_actual"] - off["meta"], off["chunk_status"] - off["meta"]
        actual = host[a_off:a_off + 8 * chunks].view("<u8")
        status = host[s_off:s_off + 4 * chunks].view("<i4")
        bad = meta["acc"] != expect
        ans = [p for p in plans if p.kind == "ans"] if chunks else []
        if ans:  # per ANS segment (in chunk order): decompressed bytes, and whether any chunk failed
            firsts = sorted(p.chunk0 for p in ans)
            sums = dict(zip(firsts, np.add.reduceat(actual, firsts).tolist()))
            fails = dict(zip(firsts, np.logical_or.reduceat(status != 0, firsts).tolist()))
        # Verdicts segment by segment only where one can fail beyond its CRC32C: a bad CRC, or ANS.
        for p in [plans[j] for j in np.flatnonzero(bad).tolist()] + [p for p in ans if not bad[p.meta]]:
            if bad[p.meta]:
                results[p.i] = PayloadChecksumMismatch(f"segment {p.i}: payload CRC32C mismatch")
            elif p.kind == "ans":
                got = sums[p.chunk0]
                if fails[p.chunk0]:
                    sl = status[p.chunk0:p.chunk0 + int(p.sizes.size)]
                    st = int(sl[np.flatnonzero(sl)[0]])
                    results[p.i] = SegmentError(f"segment {p.i}: nvCOMP ANS decompression failed "
                                                f"({self.nvcomp().status_name(st)})")
                elif got != p.h.original_length:
                    results[p.i] = LengthMismatch(f"segment {p.i}: ANS decompressed {got} bytes, "
                                                  f"header says {p.h.original_length}")
