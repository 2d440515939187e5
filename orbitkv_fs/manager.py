"""The Cache Manager: engines, namespaces, the DRAM arena, the save/restore pipeline and the tier seams.

The Manager owns codec selection, workspace, checksums and transfer lifetimes. Connectors only register
geometry and forward lookup/save/restore; the Manager reads and writes the engine's pages itself (host pages
in a shared-memory file, or GPU tensors imported through CUDA IPC).

Public API (in-process; :mod:`orbitkv_fs.client` exposes the same calls embedded or over the data plane,
the HTTP plane in :mod:`orbitkv_fs.server` calls the same methods):

* engines: :meth:`Manager.register_engine`, :meth:`~Manager.list_engines`, :meth:`~Manager.get_engine`,
  :meth:`~Manager.unregister_engine` (waits for the engine's outstanding work). A registration that
  names its process (``pid``, ``pid_start_time``) is watched: a thread checks every
  ``engine_check_interval`` seconds whether that process still runs (a pidfd where the kernel has them,
  else ``kill(pid, 0)`` plus the start time in ``/proc/PID/stat``, so a reused pid is not taken for the
  engine) and unregisters a dead engine's registration itself, through :meth:`~Manager.unregister_engine`'s
  path (counted as ``engines_reaped``).
* access: every engine call (lookup, save, restore, release, unregister, an engine's invalidation) takes a
  ``caller`` (:class:`~orbitkv_fs.access.Caller`): the data plane passes the credential the call carried
  (and the connection's OS user), and the call runs only with the credential the engine's registration
  answered (:attr:`EngineInfo.credential`). ``caller=None`` is a trusted in-process call. A registration
  maps only regular files -- from a caller, only files directly inside ``shm_dir`` that belong to the
  caller's OS user -- and memory no other engine holds (by identity, not by name:
  :class:`~orbitkv_fs.access.HandleClaims`).
* data path: :meth:`~Manager.lookup` (leading run of present chunks, under a lease),
  :meth:`~Manager.save`, :meth:`~Manager.restore`, :meth:`~Manager.release`. A lease that neither a
  restore nor a release ends within ``lease_ttl`` seconds (its engine timed out and never came back for it)
  expires: the housekeeping thread drops it, so its extents can be evicted again (``leases_expired``).
* admin: :meth:`~Manager.invalidate`, :meth:`~Manager.stats` (:class:`ManagerStats`, what metrics are built
  from), :meth:`~Manager.flush_dram`, :meth:`~Manager.list_objects`, :meth:`~Manager.config`.

Seams for the other parts:

* **Lower tier** (:class:`LowerTier`, implemented by ``orbitkv_fs.tiers.ssd.SsdTier``). Pass it as
  ``Manager(config, lower_tier=...)``; ``None`` means DRAM only. When DRAM evicts an object (or on
  :meth:`~Manager.flush_dram`) the Manager calls ``submit(key, segment_bytes)`` with an immutable ``bytes``
  the tier may keep; ``submit`` must not block on I/O (asynchronous writeback) and returns False when it
  drops the object (lane full, disabled). On a DRAM miss the Manager calls ``read(key)`` (``bytes`` of a
  CRC-valid segment or ``None``; corrupt -> ``None``), checks its header against the key again (the tier
  validated every CRC: the payload is not checksummed a second time) and readmits it to DRAM.
  ``contains``, ``invalidate``, ``flush``, ``stats``, ``iter_objects`` and ``close`` serve lookup, admin and
  shutdown. The Manager closes the tier in :meth:`~Manager.close`. A tier with ``prefetch(keys, sink,
  max_bytes=)`` (the SSD tier) gets speculative readahead: the Manager remembers which chunks followed
  which in saves and lookups, and after a lookup or restore that the lower tier (or an earlier prefetch)
  served, asks for the next ``ssd_prefetch_chunks`` chunks of that prefix; what lands is admitted to DRAM
  as prefetched (counted as a hit when first served, as wasted when it leaves DRAM unserved).
  A tier with ``device_io`` true (the SSD tier on the cuFile backend) also gets the direct path when the
  GPU codec engine serves GPU pages: a save batch hands each complete state group of a batch (every
  (layer, role) segment of a chunk in that batch) to ``submit_device`` from the engine's ``device_sink``,
  while DRAM still admits every segment (fragmented groups and host-coded segments reach the tier only
  through DRAM's demotion, as before; a direct record is not written again when DRAM demotes the same
  segment); a restore reads the segments only the tier holds with ``read_many_device`` (sizes from
  ``describe``) and decodes them on the GPU from device memory, without readmitting them to DRAM (that
  would bounce them through the host). Counted as ``ssd_direct_writes`` / ``ssd_direct_reads``.
* **Peers** (:class:`PeerFetcher`): ``Manager(..., peer_fetcher=...)`` or :meth:`~Manager.set_peer_fetcher`.
  On a miss in DRAM and the lower tier, a fetcher with ``fetch_into(manager, keys)`` (the peer client)
  reads straight into the arena through :meth:`~Manager.reserve` / :meth:`~Manager.publish` (which
  verifies in place); the Manager then leases what landed and serves it like DRAM hits. Otherwise it calls
  ``fetch(keys) -> {key: segment bytes}``; every answer is verified like any segment (header, the key's
  namespace/layer/role, CRC32C) and a bad one is a miss. ``lookup_prefix(namespace, chunks, layers)`` lets lookups count chunks peers hold. For serving peers:
  :meth:`~Manager.lease_objects` leases extents by key (objects only the lower tier holds are read back into
  DRAM first, bounded), :meth:`~Manager.read_object` returns a segment's
  bytes from any local tier, :meth:`~Manager.arena_info` gives the arena's file path, size and base address
  (for the Transfer Engine to register), and :meth:`~Manager.reserve` / :meth:`~Manager.publish` /
  :meth:`~Manager.abort` let a transfer write verified segment bytes straight into the arena.
* **GPU codec engine**: with a GPU (and ``orbitkv_fs.gpu`` importable), encode/decode batches go through a
  small adapter over its batch API; without one the host codecs (:mod:`orbitkv_fs.codecs`) run. GPU pages
  move in one block-copy launch per batch (the gather of a save, the scatter of a restore, from tables of
  block addresses), and the batches of a save or restore are pipelined: batch i+1 is gathered and queued
  on the GPU (``encode_submit`` / ``decode_submit``) before the host waits for batch i and publishes or
  scatters it, each batch taking at most half the codec budget so that two share the engine's workspace.

Invariants:

1. No segment is served without a valid header and CRC32C; a bad segment is a miss for its key, reported in
   :class:`RestoreResult`, never an exception that stops the Manager.
2. Nothing is published before its bytes are in place; an extent under a lease is never freed, evicted or
   overwritten; invalidated or evicted leased objects are hidden at once and reclaimed when leases drain.
3. A restore validates every destination before writing anything.
4. Every reservation (arena bytes, leases, workspace) returns to zero when requests complete or fail:
   :class:`ManagerStats` ``reserved_bytes``, ``leases_active``, ``workspace_bytes``, ``inflight_requests``.
5. Bytes are never served across storage namespaces (:func:`orbitkv_fs.namespace.namespace_v2`).
6. An engine is reaped only when the very process it registered (pid and start time) is gone; an engine
   whose process the Manager cannot identify (another PID namespace, no ``/proc``) is never reaped.
7. An engine acts only as itself: a caller restores into, saves from, looks up, releases leases of and
   unregisters only the engine whose credential it holds, and invalidates only that engine's namespace
   (anything wider is :class:`~orbitkv_fs.access.AdminRequired`); one piece of memory is held by at most
   one engine.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import threading
import time
import uuid
import weakref
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import msgspec
import numpy as np

from .access import AdminRequired, Caller, HandleClaims, authorize, file_identity, issue_credential, open_pages_file
from .codecs import CODEC_NAMES, LOSSY_CODECS, Codec, decode_payload, encode_segment, get_codec, raw_segment
from .errors import CodecError, CodecUnavailable, OrbitKVError, SegmentError, UnknownFormat
from .geometry import (
    AttentionKind,
    CudaIpcHandle,
    EngineRegistration,
    GeometryError,
    HostPagesHandle,
    TensorDesc,
    block_views,
    check_imported,
    layer_attention,
    num_blocks,
    parse_dtype,
    process_start_time,
    validate_registration,
)
from .histogram import DURATION_BUCKETS_S, DurationCounter, DurationHistogram
from .keys import ObjectKey, key_layer_role, pack_key
from .namespace import namespace_v2
from .pages import BLOCK_COPY_DTYPE, HostPages, PagesError, cupy_dtype, import_cuda_tensor
from .segment import (
    HEADER_SIZE,
    MAX_STORED_BYTES,
    TURBOQUANT_HEAD_DIMS,
    Format,
    HeaderTemplates,
    RawReason,
    Role,
    SegmentHeader,
    crc32c,
    dtype_code,
    pack_header_into,
    parse_header,
    parse_segment,
    peek_source,
    turboquant_stored_bytes,
)
from .hostmem import host_address
from .tiers.dram import UNIT, DramTier, arena_dir, units_of

log = logging.getLogger(__name__)

__all__ = [
    "ArenaInfo",
    "ChunkBlocks",
    "CudaIpcHandle",
    "DURATION_BUCKETS_S",
    "DurationHistogram",
    "EngineBusy",
    "EngineInfo",
    "EngineRegistration",
    "FlushResult",
    "GeometryError",
    "HostPagesHandle",
    "InvalidateResult",
    "LeaseError",
    "LookupResult",
    "LowerTier",
    "Manager",
    "ManagerConfig",
    "ManagerStats",
    "ObjectExtent",
    "ObjectInfo",
    "ObjectPage",
    "PeerFetcher",
    "PoolExhausted",
    "RequestError",
    "RestoreResult",
    "SaveResult",
    "TensorDesc",
    "TierCounts",
    "UnknownEngine",
]


# ---------------------------------------------------------------------------------------------- errors


class RequestError(OrbitKVError, ValueError):
    """A save/restore/lookup request is malformed (unknown block, wrong size, layer out of range, bad key).
    Nothing was written."""


class UnknownEngine(OrbitKVError, KeyError):
    """No engine with that id is registered (or it is being unregistered)."""


class EngineBusy(OrbitKVError):
    """The engine id is taken, or unregister timed out waiting for outstanding work."""


class LeaseError(OrbitKVError, KeyError):
    """Unknown or already released lease id."""


class PoolExhausted(OrbitKVError):
    """The DRAM pool cannot make room: what is left is leased or reserved."""


# ---------------------------------------------------------------------------------------------- config


class ManagerConfig(msgspec.Struct, frozen=True):
    """Manager settings; :mod:`orbitkv_fs.server.cli` builds it from the command line."""

    pool_size: int = 1 << 30
    #: Default codec of engines that do not ask for one: none|ans|fp8|turboquant-4|turboquant-3.
    storage_codec: str = "none"
    #: Bytes of codec workspace per worker (``--storage-codec-budget``): bounds the GPU engine's retained
    #: workspace arena and, at half of it, the encoded bytes of one codec batch (whose source bytes are at
    #: most ``BATCH_EXPANSION`` times that: a compressing codec's batch carries more source per batch).
    storage_codec_budget: int = 64 << 20
    eviction: str = "lru"  # lru | s3fifo
    #: Directory of the arena file (a tmpfs: /dev/shm where it exists).
    shm_dir: str = "/dev/shm"
    #: "auto": pin with cudaHostRegister and use the GPU codec engine when a GPU is present; "cpu": never.
    device: str = "auto"
    #: Segments encoded per codec batch, at most (the GPU engine's MAX_BATCH; the codec budget closes a
    #: batch earlier where segments are large). At 64, 512 KiB segments of fp8 and turboquant-4 ran in 2-4x
    #: as many batches as the workspace allowed, and saved 1.13-1.22x slower
    #: (docs/results/2026-11-30-batch-segments).
    batch_segments: int = 256
    #: Speculative SSD prefetch (``--ssd-prefetch-chunks``, ``--ssd-prefetch-bytes``): after a lookup or
    #: restore hits SSD-resident chunks of a prefix, up to this many following chunks of the prefix (and
    #: at most this many record bytes) are read into DRAM on the SSD tier's background lane. 0: off.
    ssd_prefetch_chunks: int = 2
    ssd_prefetch_bytes: int = 32 << 20
    #: Seconds between checks that watched engines' processes (registrations with a ``pid``) still run;
    #: a dead one is unregistered. 0: never checked.
    engine_check_interval: float = 1.0
    #: Seconds a lookup's (or a peer's) lease lives unless a restore or release ends it first. 0: forever.
    lease_ttl: float = 300.0


# ---------------------------------------------------------------------------------------------- requests / results


#: A restore destination that is not written: that block's part of the chunk is read and dropped. An engine
#: whose own prefix cache already holds the chunk's first blocks (or that needs only its first blocks) loads
#: the rest of a multi-block chunk without touching the blocks it shares with other requests.
SKIP_BLOCK = -1


class ChunkBlocks(msgspec.Struct, frozen=True, array_like=True):
    """One chunk of a save/restore: its 16-byte chunk key (:func:`orbitkv_fs.keys.chunk_key`) and the
    engine block ids (in token order) that hold it. In a restore, :data:`SKIP_BLOCK` entries are positions
    of the chunk left unwritten (the segment still spans every position)."""

    key: bytes
    blocks: list[int]


class EngineInfo(msgspec.Struct, frozen=True):
    engine_id: str
    namespace: str  # hex of the 16-byte namespace v2
    codec: str
    model: str
    layer_start: int
    layer_end: int
    num_blocks: int
    segments_per_chunk: int
    #: Layers stored exact whatever the codec (TurboQuant policy: stage edges, MLA, recurrent, unverified).
    exact_layers: list[int]
    device: str  # "host" (shared-memory pages) or "cuda:N"
    registration: EngineRegistration
    #: True when the Manager watches the registration's ``pid`` and unregisters the engine when it exits.
    watched: bool = False
    #: The engine's secret: every engine call must carry it. Set only in the answer to the registration
    #: (which goes to the registrant alone); empty in every other EngineInfo.
    credential: str = ""


class LookupResult(msgspec.Struct, frozen=True):
    #: Number of leading chunks present in full (every layer and role of this engine).
    count: int
    #: Lease holding those chunks' DRAM extents until restore/release; 0 when count is 0 or no lease asked.
    lease_id: int = 0
    #: Of ``count``: chunks served from DRAM, promoted from the lower tier, from peers.
    dram: int = 0
    lower: int = 0
    peer: int = 0


class SaveResult(msgspec.Struct, frozen=True):
    chunks_saved: int  # chunks with at least one new segment admitted
    chunks_present: int  # chunks already fully cached (nothing done)
    segments: int  # segments admitted
    logical_bytes: int  # source bytes of the admitted segments
    stored_bytes: int  # segment bytes (header + payload) admitted
    raw_segments: dict[str, int] = {}  # raw reason -> count (codec declined / policy)
    dropped_segments: int = 0  # neither DRAM nor the lower tier took them (pool full of leased objects)
    seconds: float = 0.0


class Miss(msgspec.Struct, frozen=True, array_like=True):
    """A chunk a restore could not serve, and why (``missing``, ``corrupt: <error>``, ``peer: ...``)."""

    key: bytes
    reason: str


class RestoreResult(msgspec.Struct, frozen=True):
    #: Per requested chunk, True when every segment of it was written to its destination.
    restored: list[bool]
    misses: list[Miss]
    segments: int
    logical_bytes: int
    stored_bytes: int
    seconds: float = 0.0


class TierCounts(msgspec.Struct, frozen=True):
    objects: int = 0
    bytes: int = 0


class InvalidateResult(msgspec.Struct, frozen=True):
    dram: TierCounts
    lower: TierCounts


class FlushResult(msgspec.Struct, frozen=True):
    submitted: TierCounts
    dropped: TierCounts
    skipped_leased: int


class ObjectExtent(msgspec.Struct, frozen=True, array_like=True):
    """A cached object inside the arena file: valid while its lease is held."""

    offset: int
    length: int
    generation: int


class ObjectInfo(msgspec.Struct, frozen=True):
    key: str  # str(ObjectKey): namespace/chunk/Llayer/role
    tier: str  # dram | lower
    format: str
    original_length: int
    stored_length: int
    generation: int = 0


class ObjectPage(msgspec.Struct, frozen=True):
    objects: list[ObjectInfo]
    next_cursor: str | None


class ArenaInfo(msgspec.Struct, frozen=True):
    path: str
    size: int
    base_address: int
    pinned: bool


class ManagerStats(msgspec.Struct, frozen=True):
    """A consistent snapshot of the Manager's counters and gauges (metrics are built from it)."""

    engines: int
    pool_capacity_bytes: int
    pool_used_bytes: int  # allocated extents, published or reserved
    resident_objects: dict[str, int]  # tier -> objects
    resident_bytes: dict[str, dict[str, int]]  # tier -> representation (raw|ans|fp8|turboquant) -> bytes
    resident_logical_bytes: int  # DRAM objects at their original size
    hits: dict[str, int]  # tier (dram|lower|peer) -> segments served
    misses: int  # segments not found in any tier
    lookups: int
    lookup_chunks_hit: int
    evictions: int
    evicted_bytes: int
    demoted: int  # evicted objects the lower tier took
    save_requests: int
    save_logical_bytes: int
    save_stored_bytes: int
    save_seconds: float
    restore_requests: int
    restore_logical_bytes: int
    restore_stored_bytes: int
    restore_seconds: float
    codec_batches: int
    codec_segments: dict[str, int]  # representation -> segments encoded
    encode_seconds: float
    decode_seconds: float
    raw_segments: dict[str, int]  # raw reason -> count
    decode_failures: int  # segments that failed validation or decode (served as misses)
    dropped_segments: int
    reserved_bytes: int  # arena bytes reserved, not yet published
    leases_active: int
    leased_bytes: int
    workspace_bytes: int
    inflight_requests: int
    lower: dict[str, float] = {}  # the lower tier's own stats()
    #: save/restore (per request), encode (per codec batch), decode (per segment) durations.
    durations: dict[str, DurationHistogram] = {}
    #: The GPU codec engine (zero/empty without one): device workspace retained by its workers now, how
    #: often a workspace was (re)allocated to grow, and per worker (save|restore) its batches, the
    #: segments those batches carried, and the segments it coded on the host instead (CPU fallbacks).
    gpu_workspace_bytes: int = 0
    gpu_workspace_grows: int = 0
    gpu_batches: dict[str, int] = {}
    gpu_segments: dict[str, int] = {}
    gpu_cpu_fallbacks: dict[str, int] = {}
    #: Speculative SSD prefetch: segments (and their bytes) read ahead into DRAM, prefetched objects later
    #: served (hits), and prefetched objects that left DRAM without being served (wasted).
    prefetch_segments: int = 0
    prefetch_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    #: Engines the Manager unregistered because their process had exited.
    engines_reaped: int = 0
    leases_expired: int = 0
    #: The cuFile direct path (an SSD tier with ``--ssd-backend cufile`` under the GPU codec engine):
    #: segments saves wrote from device memory straight to the SSD, and segments restores read from the
    #: SSD into device memory and decoded there (the rest go through DRAM and io_uring writeback).
    ssd_direct_writes: int = 0
    ssd_direct_reads: int = 0


# ---------------------------------------------------------------------------------------------- seams


@runtime_checkable
class LowerTier(Protocol):
    """A tier below DRAM (the SSD log). See the module docstring for the contract."""

    name: str

    def submit(self, key: ObjectKey, segment: bytes, *, timeout: float = 0.0) -> bool:
        """Queue ``segment`` (header + payload, CRC-valid) for asynchronous writeback. Never blocks on
        I/O; False when dropped. A later submit of the same key replaces the earlier one. With ``timeout``
        it may wait that long for room in the lane (bulk demotion, e.g. :meth:`Manager.flush_dram`)."""

    def read(self, key: ObjectKey) -> bytes | None:
        """The segment bytes of ``key`` after CRC validation, or None (absent, or corrupt: then that
        record is invalidated)."""

    def read_many(self, keys: Sequence[ObjectKey],
                  sink: Callable[[int, "bytes | memoryview"], None] | None = None) -> list[bytes | None]:
        """:meth:`read` of several keys with their I/O in flight together (a restore's misses). With
        ``sink``, each valid segment goes to ``sink(index, segment)`` as it lands instead of into the
        list (a view valid during the call only: lookups admit it to DRAM while later reads are in flight)."""

    def contains(self, key: ObjectKey) -> bool:
        """True when ``key`` is readable (published)."""

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, namespace: bytes | None = None,
                   chunks: Sequence[bytes] | None = None, all: bool = False) -> TierCounts:
        """Hide the matching objects (``keys``; the ``chunks`` of ``namespace``, held or not; all of
        ``namespace``; ``all``) from readers at once, and answer (how many, their stored bytes) only once
        the invalidation is durable: a restart never brings them back."""

    def flush(self) -> None:
        """Wait until every submitted object is published (or dropped)."""

    def stats(self) -> Mapping[str, float]:
        """The tier's counters and gauges (flat, Prometheus-style names without the orbitkv_ prefix)."""

    def iter_objects(self, namespace: bytes | None = None) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, stored_bytes)`` of the published objects, optionally of one namespace."""

    def close(self) -> None:
        """Flush and release everything."""


@runtime_checkable
class PeerFetcher(Protocol):
    """Other Managers, asked after DRAM and the lower tier miss."""

    def fetch(self, keys: Sequence[ObjectKey]) -> Mapping[ObjectKey, bytes]:
        """Segment bytes for whichever of ``keys`` peers hold (unverified: the Manager verifies them)."""

    def lookup_prefix(self, namespace: bytes, chunks: Sequence[bytes], layers: Sequence[tuple[int, int]]) -> int:
        """How many leading ``chunks`` a peer holds in full (every ``(layer, role)`` of ``layers``)."""



# ---------------------------------------------------------------------------------------------- the Manager


class _Seg:
    """One segment of every chunk of an engine: a (layer, role) of one tensor, and how to code it."""

    __slots__ = ("layer", "role", "desc", "codec", "raw_reason", "block_shape", "block_bytes", "dtype", "dtype_code",
                 "view", "base", "copy", "on_host", "codec_name", "_bounds")

    def __init__(self, reg: EngineRegistration, desc: TensorDesc, array, role: Role, codec: Codec | None,
                 raw_reason: RawReason) -> None:
        self.layer = desc.layer
        self.role = role
        self.desc = desc
        self.codec = codec
        self.codec_name = codec.codec_id if codec is not None else "none"
        self.raw_reason = raw_reason
        self._bounds: dict[int, int] = {}  # blocks in a chunk -> coded_bound
        self.dtype = np.dtype(parse_dtype(desc.dtype))
        try:  # what a segment header of this tensor says (None: no header can match a dtype the format lacks)
            self.dtype_code: int | None = dtype_code(self.dtype)
        except SegmentError:
            self.dtype_code = None
        # block -> view of that block, specialised per layout (the hot loop of save and restore). ``base``,
        # where the layout allows, is a block-major view (base[b] is block b): a whole chunk then moves
        # with one gather or scatter (:meth:`gather`, :meth:`scatter`) instead of a copy per block.
        self.base = None
        if desc.layout == "vllm_packed":
            half = slice(0, reg.head_dim) if role == Role.KEY else slice(reg.head_dim, 2 * reg.head_dim)
            self.base = array[:, :, :, half]
            self.view = self.base.__getitem__
        elif desc.layout == "sglang_token_pool":
            t = reg.block_size
            self.view = lambda b: array[b * t:(b + 1) * t]
            n = array.shape[0] // t
            split = array[:n * t].reshape((n, t) + tuple(array.shape[1:]))
            if split.strides[:2] == (array.strides[0] * t, array.strides[0]):  # a view, not a copy
                self.base = split
        else:
            self.base = array
            self.view = array.__getitem__
        v = self.view(0)
        self.on_host = isinstance(v, np.ndarray)
        assert any(r == role and w.shape == v.shape for r, w in block_views(reg, desc, array, 0))
        self.block_shape = tuple(v.shape)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        # GPU pages whose blocks the engine's block-copy kernel can move (a whole batch in one launch):
        # (address of block 0, block stride, rows, row bytes, row stride) of a block as regular rows.
        self.copy: tuple[int, int, int, int, int] | None = None
        if self.base is not None and not isinstance(self.base, np.ndarray):
            rows = _rows_of(self.block_shape, self.base.strides[1:], self.dtype.itemsize)
            if rows is not None:
                self.copy = (int(self.base.data.ptr), int(self.base.strides[0])) + rows

    def coded_bound(self, nblocks: int) -> int:
        """:func:`_coded_bound` of a chunk of ``nblocks`` blocks (asked once per segment of every save)."""
        b = self._bounds.get(nblocks)
        if b is None:
            b = self._bounds[nblocks] = _coded_bound(self, nblocks * self.block_bytes)
        return b

    def gather(self, blocks: Sequence[int]):
        """The blocks as one C-contiguous array ``[len(blocks), *block_shape]`` of the pages' kind (numpy
        or cupy): one gather where the layout has a block-major view."""
        if self.base is not None:
            xp = _array_module(self.base)
            run = _run_of(blocks)
            if run is not None:  # consecutive blocks: a plain copy, no index array to upload
                return xp.ascontiguousarray(self.base[run])
            return xp.take(self.base, xp.asarray(blocks, dtype=np.int64), axis=0)
        xp = _array_module(self.view(blocks[0]))
        return xp.stack([self.view(b) for b in blocks])

    def scatter(self, blocks: Sequence[int], src) -> None:
        """Write ``src`` (``[len(blocks), *block_shape]``, same array kind as the pages) into the blocks;
        positions whose block is :data:`SKIP_BLOCK` are not written."""
        if SKIP_BLOCK in blocks:
            keep = [j for j, b in enumerate(blocks) if b != SKIP_BLOCK]
            run = _run_of(keep)  # the usual case: leading and trailing skips, a plain slice of src
            blocks, src = [blocks[j] for j in keep], src[run] if run is not None else src[keep]
        if self.base is not None:
            run = _run_of(blocks)
            if run is not None:
                self.base[run] = src
                return
            xp = _array_module(self.base)
            self.base[xp.asarray(blocks, dtype=np.int64)] = src
            return
        for j, b in enumerate(blocks):
            self.view(b)[...] = src[j]


class _Engine:
    def __init__(self, info: EngineInfo, reg: EngineRegistration, ns: bytes, segs: list[_Seg],
                 num_blocks: int, imports: list, watch: "_ProcessWatch | None", secret: bytes,
                 owner_uid: int | None) -> None:
        self.info = info
        self.secret = secret  # the credential, as bytes
        self.owner_uid = owner_uid  # the registering OS user, when known
        self.reg = reg
        self.ns = ns
        self.segs = segs
        self.num_blocks = num_blocks
        self.imports = imports  # closed on unregister (the watch too, when there is one)
        self.watch = watch
        self.inflight = 0
        self.closing = False
        self.leases: set[int] = set()


class _ProcessWatch:
    """Whether one engine process still runs. A pidfd names the process itself, so a reused pid cannot
    fool it; without one (no ``os.pidfd_open``, a kernel before 5.3, a seccomp filter) ``kill(pid, 0)``
    and the start time in ``/proc/PID/stat`` (a zombie counts as dead) tell the same."""

    __slots__ = ("pid", "start", "fd")

    def __init__(self, pid: int, start: int, fd: int) -> None:
        self.pid = pid
        self.start = start
        self.fd = fd

    @classmethod
    def open(cls, pid: int, start: int | None) -> "_ProcessWatch | None":
        """A watch on ``pid``; None when this host shows no running process ``pid`` that started at
        ``start`` (another PID namespace, a reused pid, no ``/proc``): such an engine is not watched."""
        fd = -1
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                fd = pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:
                fd = -1
        # Read after the pidfd is open: if the pid changed hands in between, the start time differs.
        now = process_start_time(pid)
        if now is None or (start is not None and now != start):
            if fd >= 0:
                os.close(fd)
            return None
        return cls(pid, now, fd)

    def alive(self) -> bool:
        if self.fd >= 0:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            return not p.poll(0)  # a pidfd turns readable when its process exits
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        return process_start_time(self.pid) == self.start

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Lease:
    __slots__ = ("engine_id", "chunks", "entries", "expires")

    def __init__(self, engine_id: str | None) -> None:
        self.engine_id = engine_id
        self.chunks: list[bytes] = []  # pinned (namespace + chunk)
        self.entries: list[tuple[int, int]] = []  # leased (slot, generation)
        self.expires = float("inf")  # time.monotonic() deadline once handed out (lease_ttl)


_REP_NAMES = {int(f): f.name.lower() for f in Format}
# Offsets of a batch's gathered segments inside their one device buffer: aligned for the kernels' wide loads.
_SLICE_ALIGN = 256


def _check_keys(chunks: Sequence[bytes]) -> None:
    """Raises :class:`RequestError` naming the first of ``chunks`` that is not a 16-byte key."""
    for i, c in enumerate(chunks):
        if not isinstance(c, bytes) or len(c) != 16:
            raise RequestError(f"chunks[{i}]: a chunk key is 16 bytes")


def _check_key(kb: bytes, h: SegmentHeader) -> None:
    layer, role = key_layer_role(kb)
    if h.layer != layer or h.role != role:
        raise UnknownFormat(f"segment is layer {h.layer}/{h.role.name}, the key says {layer}/{Role(role).name}")


def _verify(kb: bytes, blob) -> SegmentHeader:
    """Full validation of a segment claimed to be the object ``kb``. Raises SegmentError."""
    h, _ = parse_segment(blob)
    _check_key(kb, h)
    return h


def _verify_header(kb: bytes, blob: bytes) -> SegmentHeader:
    """Header validation of a segment whose payload CRC a tier just checked (prefetched from the SSD tier,
    which verifies every record's CRCs): header CRC and fields, the key's layer/role, the length. Raises
    SegmentError. Spares a second CRC pass over the payload."""
    h = _HEADERS.parse(blob)
    _check_key(kb, h)
    if len(blob) != HEADER_SIZE + h.stored_length:
        raise SegmentError(f"segment of {len(blob)} bytes, its header says {HEADER_SIZE + h.stored_length}")
    return h


#: The restore's header checks: a batch's headers differ only in their payload CRC.
_HEADERS = HeaderTemplates()
#: Expired lease ids remembered so that a late restore under one is served, not refused.
_EXPIRED_IDS_KEPT = 4096
#: Segments a lookup reads from the lower tier in one batch (all in flight together).
_PROMOTE_WINDOW = 256
#: Segments one peer lease request may read back from the lower tier into DRAM.
_PEER_READMIT_SEGMENTS = 256
#: Chunks whose successors the prefetch remembers (about 100 bytes each).
_PREFIX_MEMORY = 1 << 16


class Manager:
    """One per host (remote mode) or per engine process (embedded mode). Thread-safe."""

    def __init__(self, config: ManagerConfig | None = None, *, lower_tier: LowerTier | None = None,
                 peer_fetcher: PeerFetcher | None = None) -> None:
        """Create the arena file, pin it when a GPU is present, start with no engines."""
        self._config = config = config or ManagerConfig()
        if config.storage_codec not in CODEC_NAMES:
            raise CodecError(f"unknown storage codec {config.storage_codec!r}; expected {', '.join(CODEC_NAMES)}")
        if config.storage_codec == "ans":
            get_codec("ans")  # CodecUnavailable here rather than at the first save
        if config.device not in ("auto", "cpu"):
            raise ValueError(f"device {config.device!r}: expected auto or cpu")
        if config.ssd_prefetch_chunks < 0 or config.ssd_prefetch_bytes < 0:
            raise ValueError("ssd_prefetch_chunks and ssd_prefetch_bytes must be >= 0")
        if config.engine_check_interval < 0:
            raise ValueError("engine_check_interval must be >= 0")
        if config.lease_ttl < 0:
            raise ValueError("lease_ttl must be >= 0")
        self._gpu = config.device != "cpu" and _gpu_present()
        self._gpu_codecs: _GpuCodecs | None = None
        if self._gpu:
            try:
                self._gpu_codecs = _GpuCodecs(config.storage_codec_budget)
            except (ImportError, CodecUnavailable) as e:  # no gpu extra, or a GPU older than the kernels
                log.warning("GPU present but the GPU codec engine is unavailable (%s); using host codecs", e)
        self.lower = lower_tier
        self.peers = peer_fetcher
        self.dram = DramTier(config.pool_size, shm_dir=config.shm_dir, policy=config.eviction, pin=self._gpu,
                             demote=lower_tier.submit if lower_tier is not None else None)
        if self.dram.reclaimed[0]:
            log.warning("removed %d arena files (%.1f MB) of Managers that were killed, from %s",
                        self.dram.reclaimed[0], self.dram.reclaimed[1] / 1e6, config.shm_dir)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._engines: dict[str, _Engine] = {}
        self._claims = HandleClaims()  # memory identities registered engines hold
        _st = os.stat(self.dram.arena.path)
        self._arena_identity = ("file", _st.st_dev, _st.st_ino)
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._reservations: dict[int, tuple[int, int]] = {}  # id -> (offset, nbytes)
        self._res_ids = itertools.count(1)
        self._stat_lock = threading.Lock()
        self._c: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._hits = {"dram": 0, "lower": 0, "peer": 0}
        self._codec_segments: dict[str, int] = {}
        self._raw: dict[str, int] = {}
        self._workspace = 0
        self._durations = {name: DurationCounter() for name in _DURATIONS.values()}
        self._inflight = 0
        self._closed = False
        # Prefix memory for prefetch: namespace + chunk -> the chunks that followed it in a save or
        # lookup (up to ssd_prefetch_chunks of them), least recently recorded first.
        self._succ: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()
        self._succ_lock = threading.Lock()
        self._inval_epoch = 0  # bumped by invalidate(): a prefetch that raced one is not kept
        # the housekeeping thread (dead engines, expired leases): started with the first watched engine
        # or the first lease that can expire
        self._housekeeper: threading.Thread | None = None
        self._housekeeper_stop = threading.Event()
        # recently expired lease ids -> engine id: a late restore naming one still runs, without the lease
        self._expired: collections.OrderedDict[int, str | None] = collections.OrderedDict()

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _add(self, **kw: float) -> None:
        with self._stat_lock:
            for k, v in kw.items():
                self._c[k] += v
                hist = _DURATIONS.get(k)
                if hist is not None:  # every *_seconds add is one observation of that duration
                    self._durations[hist].observe(v)

    def _add_per_segment(self, key: str, seconds: float, n: int) -> None:
        """A batch's ``seconds`` under the ``*_seconds`` counter ``key``, observed by its histogram as ``n``
        segments of ``seconds / n`` each (one lock round, not one per segment)."""
        with self._stat_lock:
            self._c[key] += seconds
            self._durations[_DURATIONS[key]].observe(seconds / n, n)

    def _count(self, table: dict[str, int], name: str, n: int = 1) -> None:
        with self._stat_lock:
            table[name] = table.get(name, 0) + n

    def _workspace_delta(self, n: int) -> None:
        with self._stat_lock:
            self._workspace += n

    def _enter(self, engine_id: str, caller: Caller | None = None, *, lookup: bool = False) -> _Engine:
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing:
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            if caller is not None:
                authorize(engine_id, eng.secret, eng.owner_uid, eng.reg.lookup_by_user, caller, lookup=lookup)
            eng.inflight += 1
            self._inflight += 1
            return eng

    def _exit(self, eng: _Engine) -> None:
        with self._lock:
            eng.inflight -= 1
            self._inflight -= 1
            if eng.closing:  # only unregister waits (for a closing engine's requests to drain)
                self._cond.notify_all()

    # -- engines -------------------------------------------------------------------------------------

    def register_engine(self, reg: EngineRegistration, *, caller: Caller | None = None) -> EngineInfo:
        """Validate ``reg`` against the tensors its handles import, then register it. Raises
        :class:`GeometryError` (naming the field), :class:`~orbitkv_fs.access.HandleInUse` or
        :class:`EngineBusy` and registers nothing on any of them. A host-pages handle must name a regular
        file; with a ``caller``, directly inside ``shm_dir`` and owned by the caller's OS user. The answer carries
        the engine's credential (:attr:`EngineInfo.credential`), which every later call for the engine
        must present."""
        validate_registration(reg)
        codec_name = reg.codec or self._config.storage_codec
        if codec_name not in CODEC_NAMES:
            raise GeometryError("codec", f"unknown codec {codec_name!r}; expected {', '.join(CODEC_NAMES)}")
        if codec_name == "ans":
            try:
                get_codec("ans")
            except CodecError as e:
                raise GeometryError("codec", str(e)) from None
        imports: list = []
        try:
            watch = None
            if reg.pid is not None and self._config.engine_check_interval > 0:
                watch = _ProcessWatch.open(reg.pid, reg.pid_start_time)
                if watch is None:
                    log.warning("engine process %d is not visible to the Manager as registered (another PID "
                                "namespace, or it exited): it will not be unregistered when it dies", reg.pid)
                else:
                    imports.append(watch)
            owner_uid = caller.uid() if caller is not None else os.getuid()
            if caller is not None and owner_uid is None and any(isinstance(d.handle, HostPagesHandle)
                                                                for d in reg.tensors):
                raise GeometryError("tensors", "cannot tell which OS user sent this registration (a remote "
                                               "TCP peer?): host pages are registered over ipc:// or loopback")
            arrays, device, handles = self._import_tensors(reg, imports, caller is not None, owner_uid)
            segs: list[_Seg] = []
            exact_layers: set[int] = set()
            for desc, arr in zip(reg.tensors, arrays):
                codec, reason = _layer_codec(reg, desc, codec_name)
                if codec is None and codec_name != "none":
                    exact_layers.add(desc.layer)
                for role, _ in block_views(reg, desc, arr, 0):
                    segs.append(_Seg(reg, desc, arr, role, codec, reason))
            segs.sort(key=lambda s: (s.layer, int(s.role)))
            blocks = min(num_blocks(reg, d) for d in reg.tensors)
            ns = namespace_v2(reg, codec_name)
            with self._lock:
                if self._closed:
                    raise OrbitKVError("the Manager is closed")
                engine_id = reg.engine_id or f"{reg.engine_kind}-{uuid.uuid4().hex[:12]}"
                if engine_id in self._engines:
                    raise EngineBusy(f"engine id {engine_id!r} is already registered")
                self._claims.claim(engine_id, handles)
                info = EngineInfo(engine_id=engine_id, namespace=ns.hex(), codec=codec_name, model=reg.model,
                                  layer_start=reg.layer_start, layer_end=reg.layer_end, num_blocks=blocks,
                                  segments_per_chunk=len(segs), exact_layers=sorted(exact_layers), device=device,
                                  registration=reg, watched=watch is not None)
                credential = issue_credential()
                self._engines[engine_id] = _Engine(info, reg, ns, segs, blocks, imports, watch, credential.encode(),
                                                   owner_uid)
                if watch is not None:
                    self._start_housekeeping()
            return msgspec.structs.replace(info, credential=credential)
        except BaseException:
            _close_imports(imports)
            raise

    def _import_tensors(self, reg: EngineRegistration, imports: list, untrusted: bool,
                        owner_uid: int | None) -> tuple[list, str, list[tuple[str, tuple, int, int]]]:
        """Map every tensor's handle; check it against its descriptor. Host pages files are opened once,
        through :func:`~orbitkv_fs.access.open_pages_file`: a regular file and, for an ``untrusted``
        registrant, inside ``shm_dir`` and of ``owner_uid``. Answers the arrays, the device and each
        handle's memory identity."""
        files: dict[str, HostPages] = {}
        arrays = []
        handles: list[tuple[str, tuple, int, int]] = []
        kinds = {type(d.handle) for d in reg.tensors}
        if len(kinds) > 1:
            raise GeometryError("tensors", "host pages and CUDA IPC handles cannot be mixed in one engine")
        device = "host"
        for i, desc in enumerate(reg.tensors):
            at = f"tensors[{i}]"
            h = desc.handle
            if isinstance(h, HostPagesHandle):
                pages = files.get(h.path)
                if pages is None:
                    fd = open_pages_file(h.path, arena_dir(self._config.shm_dir) if untrusted else None,
                                         owner_uid if untrusted else None, f"{at}.handle.path")
                    ident = file_identity(fd)
                    if ident == self._arena_identity:
                        os.close(fd)
                        raise GeometryError(f"{at}.handle.path", "names the Manager's own arena file")
                    try:
                        pages = HostPages.open(h.path, fd=fd)
                    except PagesError as e:
                        raise GeometryError(f"{at}.handle.path", str(e)) from None
                    pages.identity = ident
                    files[h.path] = pages
                    imports.append(pages)
                handles.append((f"{at}.handle", pages.identity, 0, 1 << 64))
                try:
                    t, arr = pages.at(h.offset)
                except PagesError as e:
                    raise GeometryError(f"{at}.handle.offset", str(e)) from None
                check_imported(desc, at, dtype=parse_dtype(t.dtype), shape=tuple(t.shape),
                               strides=tuple(t.strides), role=t.role)
                if t.layer >= 0 and t.layer != desc.layer:
                    raise GeometryError(f"{at}.layer", f"declared {desc.layer}, the pages file says {t.layer}")
                if t.layout and t.layout != desc.layout:
                    raise GeometryError(f"{at}.layout", f"declared {desc.layout}, the pages file says {t.layout}")
            else:
                if not self._gpu:
                    raise GeometryError(f"{at}.handle", "CUDA IPC handle given, but this Manager has no GPU")
                arr, owner = import_cuda_tensor(desc, at)
                imports.append(owner)
                device = f"cuda:{h.device}"
                handles.append((f"{at}.handle", ("cuda_ipc", h.handle, h.device), h.offset, h.offset + arr.data.mem.size))
            arrays.append(arr)
        return arrays, device, handles

    def list_engines(self) -> list[EngineInfo]:
        with self._lock:
            return [e.info for e in self._engines.values() if not e.closing]

    def get_engine(self, engine_id: str) -> EngineInfo:
        """Raises :class:`UnknownEngine`."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing:
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            return eng.info

    def unregister_engine(self, engine_id: str, *, timeout: float | None = 60.0, caller: Caller | None = None) -> None:
        """Refuse new requests for the engine, wait for its outstanding ones, release its leases, codec
        resources and imported tensors. Cached objects stay (they belong to the namespace)."""
        self._unregister(engine_id, timeout, caller=caller)

    def _unregister(self, engine_id: str, timeout: float | None, only: _Engine | None = None,
                    caller: Caller | None = None) -> None:
        """:meth:`unregister_engine`; with ``only``, only that registration (not a later one that took
        the same id while the reaper looked)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing or (only is not None and eng is not only):
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            if caller is not None:
                authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
            eng.closing = True
            if not self._cond.wait_for(lambda: eng.inflight == 0, timeout):
                eng.closing = False
                raise EngineBusy(f"engine {engine_id!r} still has {eng.inflight} requests after {timeout}s")
            leases = [self._leases.pop(i) for i in list(eng.leases) if i in self._leases]
            del self._engines[engine_id]
            self._claims.release(engine_id)
        for lease in leases:
            self._drop_lease(lease)
        # The segment views are the last references into the imported memory: dropped first, the
        # imports' close unmaps the pages file (or closes the CUDA IPC mapping) at once.
        eng.segs = []
        _close_imports(eng.imports)

    def _start_housekeeping(self) -> None:
        """Start the housekeeping thread if it is not running. Called with ``_lock`` held."""
        if self._housekeeper is not None or self._closed:
            return
        c = self._config
        periods = [c.engine_check_interval] if c.engine_check_interval > 0 else []
        if c.lease_ttl > 0:
            periods.append(min(c.lease_ttl / 4, 5.0))
        self._housekeeper = threading.Thread(target=_housekeep, args=(weakref.ref(self), self._housekeeper_stop,
                                                                  min(periods, default=1.0)),
                                         name="orbitkv-housekeeping", daemon=True)
        self._housekeeper.start()

    def _hand_out(self, lease: _Lease) -> int:
        """Register ``lease`` under a new id with its expiry; answers the id. Called with ``_lock`` held."""
        lease_id = next(self._lease_ids)
        if self._config.lease_ttl > 0:
            lease.expires = time.monotonic() + self._config.lease_ttl
            self._start_housekeeping()
        self._leases[lease_id] = lease
        return lease_id

    def _expire_leases(self) -> None:
        """Drop every lease past its expiry (the housekeeping thread's round)."""
        now = time.monotonic()
        with self._lock:
            expired = [(i, lease) for i, lease in self._leases.items() if lease.expires <= now]
            for i, lease in expired:
                del self._leases[i]
                self._expired[i] = lease.engine_id
                while len(self._expired) > _EXPIRED_IDS_KEPT:
                    self._expired.popitem(last=False)
                eng = self._engines.get(lease.engine_id) if lease.engine_id else None
                if eng is not None:
                    eng.leases.discard(i)
        for _, lease in expired:
            self._drop_lease(lease)
        if expired:
            self._add(leases_expired=len(expired))
            log.warning("%d lease(s) expired after %gs without a restore or release (lease ids %s)", len(expired),
                        self._config.lease_ttl, ", ".join(str(i) for i, _ in expired[:8]))

    def _reap_dead(self) -> None:
        """Unregister every watched engine whose process has exited (the housekeeping thread's round)."""
        with self._lock:
            watched = [(i, e) for i, e in self._engines.items() if e.watch is not None and not e.closing]
        for engine_id, eng in watched:
            if eng.watch.alive():
                continue
            try:
                self._unregister(engine_id, 60.0, only=eng)
            except UnknownEngine:
                continue  # unregistered meanwhile
            except EngineBusy as e:  # requests still running for it: the next round tries again
                log.warning("engine %r (pid %d) exited but %s", engine_id, eng.watch.pid, e)
                continue
            self._add(engines_reaped=1)
            log.warning("engine %r: its process %d exited; unregistered it", engine_id, eng.reg.pid)

    # -- data path -----------------------------------------------------------------------------------

    def _check_chunks(self, eng: _Engine, chunks: Sequence[ChunkBlocks], *, skips: bool = False) -> None:
        """Keys and block ids of a request; ``skips``: :data:`SKIP_BLOCK` positions are allowed (a restore),
        as long as each chunk writes at least one block."""
        seen: set[int] = set()
        for i, ch in enumerate(chunks):
            if not isinstance(ch.key, bytes) or len(ch.key) != 16:
                raise RequestError(f"chunks[{i}].key: a chunk key is 16 bytes")
            if not ch.blocks:
                raise RequestError(f"chunks[{i}].blocks: no blocks")
            skipped = 0
            for b in ch.blocks:
                if b == SKIP_BLOCK and skips:
                    skipped += 1
                    continue
                if not 0 <= b < eng.num_blocks:
                    raise RequestError(f"chunks[{i}].blocks: unknown block {b} (engine has {eng.num_blocks})")
                if b in seen:
                    raise RequestError(f"chunks[{i}].blocks: block {b} appears twice in one request")
                seen.add(b)
            if skipped == len(ch.blocks):
                raise RequestError(f"chunks[{i}].blocks: every position is SKIP_BLOCK, nothing to restore")

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True,
               caller: Caller | None = None) -> LookupResult:
        """Length of the leading run of ``chunks`` present in full. Lower-tier objects of that run are
        promoted to DRAM; with ``lease`` the run's extents stay leased until :meth:`restore` (given the
        lease id) or :meth:`release`."""
        eng = self._enter(engine_id, caller, lookup=not lease)
        try:
            for c in chunks:
                if type(c) is not bytes or len(c) != 16:
                    _check_keys(chunks)  # raises naming the bad key (a bytes subclass passes)
                    break
            nseg = len(eng.segs)
            pin = _Lease(engine_id)
            ns_chunks = list(map(eng.ns.__add__, chunks))
            n_dram = self.dram.leading_complete(ns_chunks, nseg, pin=lease)
            if lease:
                pin.chunks.extend(ns_chunks[:n_dram])
            n_lower = 0
            if self.lower is not None and n_dram < len(chunks):
                try:
                    n_lower = self._promote_run(eng, chunks[n_dram:], pin if lease else None)
                except BaseException:  # the lower tier failed: no lease is handed out, so no pin stays
                    self._drop_lease(pin)
                    raise
            count = n_dram + n_lower
            self._remember_prefix(eng, chunks)
            if n_lower:
                self._readahead(eng, chunks[count - 1], set(chunks))
            n_peer = 0
            if count < len(chunks) and self.peers is not None:
                layers = [(s.layer, int(s.role)) for s in eng.segs]
                try:
                    n_peer = max(0, min(len(chunks) - count, self.peers.lookup_prefix(eng.ns, chunks[count:], layers)))
                except Exception as e:  # a peer failure is a miss, never a failed lookup
                    log.warning("peer lookup failed: %s", e)
            lease_id = 0
            if pin.chunks:
                with self._lock:
                    lease_id = self._hand_out(pin)
                    eng.leases.add(lease_id)
            with self._stat_lock:  # not _add: its keyword loop costs more than the counting
                self._c["lookups"] += 1
                self._c["lookup_chunks_hit"] += count + n_peer
            return LookupResult(count=count + n_peer, lease_id=lease_id, dram=n_dram, lower=n_lower, peer=n_peer)
        finally:
            self._exit(eng)

    def _promote_run(self, eng: _Engine, chunks: Sequence[bytes], pin: _Lease | None) -> int:
        """How many leading ``chunks`` the lower tier can complete: every segment DRAM lacks is held by the
        lower tier and reads back valid. Those segments are readmitted to DRAM where they fit; the rest a
        restore serves from the lower tier's bytes again, so a chunk counts whether or not DRAM could take
        it back (an arena full of leased or pinned objects). With ``pin`` the counted chunks are pinned
        (recorded in it). A segment the lower tier claimed but could not deliver (corrupt, I/O error) is a
        miss. Reads go out in windows of up to :data:`_PROMOTE_WINDOW` segments, all in flight together."""
        counted = 0
        pos = 0
        while pos < len(chunks):
            window: list[tuple[bytes, list[bytes]]] = []  # (chunk, its keys DRAM lacks)
            size = 0
            for c in chunks[pos:]:
                missing = [kb for kb in (pack_key(eng.ns, c, s.layer, s.role) for s in eng.segs)
                           if not self.dram.contains(kb)]
                if not all(self.lower.contains(ObjectKey.unpack(kb)) for kb in missing):
                    break
                window.append((c, missing))
                size += len(missing)
                if size >= _PROMOTE_WINDOW:
                    break
            if not window:
                break
            if pin is not None:
                # Pinned before the reads land, so the admissions below cannot evict each other.
                ncs = [eng.ns + c for c, _ in window]
                self.dram.pin_chunks(ncs)
                pin.chunks.extend(ncs)
            flat = [kb for _, m in window for kb in m]
            got: set[bytes] = set()

            def admit(i: int, blob: "bytes | memoryview") -> None:
                # As each read lands, while the next ones are in flight: DRAM copies it (a segment of a
                # chunk that then misses stays valid in DRAM, just not counted below).
                kb = flat[i]
                h = self._checked_header(kb, blob)
                if h is not None:
                    got.add(kb)
                    self._admit(kb, blob, h)

            self.lower.read_many([ObjectKey.unpack(kb) for kb in flat], sink=admit)
            if len(got) < len(flat):
                self._add(misses=len(flat) - len(got))
            good = 0
            for _, m in window:
                if any(kb not in got for kb in m):
                    break
                good += 1
            if pin is not None and good < len(window):
                bad = [eng.ns + c for c, _ in window[good:]]
                self.dram.unpin_chunks(bad)
                del pin.chunks[len(pin.chunks) - len(bad):]
            counted += good
            pos += good
            if good < len(window):
                break
        return counted

    def _remember_prefix(self, eng: _Engine, chunks: Sequence[bytes]) -> None:
        """Record which chunks follow which in a prefix (the order a save or lookup names them), for
        :meth:`_readahead`. Bounded: the oldest entries go past :data:`_PREFIX_MEMORY`."""
        n = self._config.ssd_prefetch_chunks
        if not n or len(chunks) < 2 or getattr(self.lower, "prefetch", None) is None:
            return
        with self._succ_lock:
            for i in range(len(chunks) - 1):
                k = eng.ns + chunks[i]
                self._succ[k] = tuple(chunks[i + 1:i + 1 + n])
                self._succ.move_to_end(k)
            while len(self._succ) > _PREFIX_MEMORY:
                self._succ.popitem(last=False)

    def _readahead(self, eng: _Engine, after: bytes, exclude: set[bytes]) -> None:
        """Speculative prefetch: the chunks that followed ``after`` in its prefix (up to
        ``ssd_prefetch_chunks``, not in ``exclude``: the request asked for those itself), their segments
        DRAM lacks, read on the lower tier's background lane (at most ``ssd_prefetch_bytes``) and admitted
        to DRAM as they land."""
        prefetch = getattr(self.lower, "prefetch", None)
        if prefetch is None or not self._config.ssd_prefetch_chunks:
            return
        with self._succ_lock:
            nxt = self._succ.get(eng.ns + after, ())
        keys = [ObjectKey(eng.ns, c, s.layer, s.role) for c in nxt if c not in exclude for s in eng.segs
                if not self.dram.contains(pack_key(eng.ns, c, s.layer, s.role))]
        if not keys:
            return
        epoch = self._inval_epoch
        try:
            prefetch(keys, lambda key, blob: self._prefetched(key, blob, epoch),
                     max_bytes=self._config.ssd_prefetch_bytes)
        except Exception as e:  # speculation must never fail the request that triggered it
            log.warning("SSD prefetch request failed: %s", e)

    def _prefetched(self, key: ObjectKey, blob: bytes, epoch: int) -> None:
        """A prefetched segment landed (on the lower tier's lane thread; the tier validated every CRC):
        admit it to DRAM as a prefetched object, unless an invalidation ran since it was requested."""
        kb = key.pack()
        if self._inval_epoch != epoch or self._closed:
            return
        try:
            h = _verify_header(kb, blob)
        except SegmentError as e:
            log.warning("lower tier prefetched a bad segment for %s: %s", key, e)
            self._add(decode_failures=1)
            return
        if self._admit(kb, blob, h, prefetched=True) is None:
            return
        if self._inval_epoch != epoch:  # the invalidation may have swept DRAM before this publish
            self.dram.invalidate(lambda k: k == kb)
            return
        self._add(prefetch_segments=1, prefetch_bytes=len(blob))

    def _read_lower(self, kb: bytes) -> bytes | None:
        return self._checked_lower(kb, self.lower.read(ObjectKey.unpack(kb)))

    def _checked_lower(self, kb: bytes, blob: bytes | None, reasons: dict[bytes, str] | None = None) -> bytes | None:
        """``blob`` as read from the lower tier for ``kb`` once verified; None when absent or bad (then
        ``reasons[kb]`` says why)."""
        if blob is None or self._checked_header(kb, blob, reasons) is None:
            return None
        return blob

    def _checked_header(self, kb: bytes, blob: "bytes | memoryview",
                        reasons: dict[bytes, str] | None = None) -> SegmentHeader | None:
        """The header of a segment the lower tier read for ``kb``, checked against the key (the tier checked
        every CRC of the bytes); None when it is bad (then ``reasons[kb]`` says why). Counts the hit."""
        try:
            h = _verify_header(kb, blob)
        except SegmentError as e:
            log.warning("lower tier returned a bad segment for %s: %s", ObjectKey.unpack(kb), e)
            self._add(decode_failures=1)
            if reasons is not None:
                reasons[kb] = f"corrupt (lower tier): {type(e).__name__}: {e}"
            return None
        self._count(self._hits, "lower")
        return h

    def _admit(self, kb: bytes, blob: bytes, h: SegmentHeader | None = None, *,
               prefetched: bool = False) -> tuple[int, int] | None:
        """Copy a verified segment (``h``: its parsed header, when the caller has it) into DRAM and publish
        it; None when it did not fit or was present."""
        h = h or parse_header(blob)
        off = self.dram.reserve(len(blob))
        if off is None:
            return None
        self.dram.view(off, len(blob))[:] = np.frombuffer(blob, dtype=np.uint8)
        return self.dram.publish(kb, off, len(blob), h.original_length, int(h.format), prefetched=prefetched)

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, caller: Caller | None = None) -> SaveResult:
        """Gather each chunk's blocks per (layer, role) into segments, encode them in batches, admit them
        to DRAM (evicting, and demoting to the lower tier, as needed). Chunks already present are skipped.
        Raises :class:`RequestError` before doing anything when a block id or key is bad."""
        t0 = time.perf_counter()
        eng = self._enter(engine_id, caller)
        try:
            self._check_chunks(eng, chunks)
            self._remember_prefix(eng, [ch.key for ch in chunks])
            todo: list[tuple[ChunkBlocks, _Seg, bytes]] = []
            acc = _SaveAcc()
            # A batch closes before its encoded bytes would pass the budget (two of them must fit side by
            # side in the GPU engine's workspace, or the next one waits for the previous one's copies). Sized
            # by encoded bytes, a compressing codec's batch carries more source, so the per-batch host work
            # is spread over more logical bytes.
            batches = self._codec_batches(self._save_items(eng, chunks, todo, acc),
                                          lambda it: it[1].coded_bound(len(it[0].blocks)), _source_bytes)
            self._save_batches(eng, batches, acc)
            present, saved_chunks = acc.present, set()
            for ch, _, kb in todo:
                if kb in acc.admitted:
                    saved_chunks.add(ch.key)
            dt = time.perf_counter() - t0
            self._add(save_requests=1, save_logical_bytes=acc.logical, save_stored_bytes=acc.stored, save_seconds=dt,
                      dropped_segments=acc.dropped)
            return SaveResult(chunks_saved=len(saved_chunks), chunks_present=present, segments=len(acc.admitted),
                              logical_bytes=acc.logical, stored_bytes=acc.stored, raw_segments=acc.raw,
                              dropped_segments=acc.dropped, seconds=dt)
        finally:
            self._exit(eng)

    def _save_items(self, eng: _Engine, chunks: Sequence[ChunkBlocks], todo: list, acc: "_SaveAcc") -> Iterator:
        """The ``(chunk, seg, key)`` segments of a save that go through the codecs, generated as the
        pipeline's batches ask for them (the first batch goes to the GPU before the later chunks are looked
        at). Every segment not cached yet is also appended to ``todo``; exact segments of host pages are
        saved here, straight into the arena; ``acc.present`` counts the chunks present in full already."""
        nseg = len(eng.segs)
        # GPU pages: exact segments go through the GPU engine too (one gather, CRC32C on the GPU, one
        # device-to-host copy into the arena per batch) rather than a host copy per block.
        raw_on_host = self._gpu_codecs is None or eng.info.device == "host"
        for ch in chunks:
            have = self.dram.chunk_count(eng.ns + ch.key)
            if have >= nseg:
                acc.present += 1
                continue
            for seg in eng.segs:
                kb = pack_key(eng.ns, ch.key, seg.layer, seg.role)
                if have and self.dram.contains(kb):  # a chunk with no segment cached needs no test per segment
                    continue
                item = (ch, seg, kb)
                todo.append(item)
                if seg.codec is None and raw_on_host:
                    self._save_raw(eng, item, acc)
                    continue
                yield item

    def _save_raw(self, eng: _Engine, item: tuple[ChunkBlocks, _Seg, bytes], acc: "_SaveAcc") -> None:
        """Exact segments are gathered straight into their arena extent: one copy, CRC over the arena."""
        ch, seg, kb = item
        n = len(ch.blocks) * seg.block_bytes
        total = HEADER_SIZE + n
        reason = seg.raw_reason.name.lower()
        if total > MAX_STORED_BYTES:
            raise RequestError(f"chunk of {len(ch.blocks)} blocks makes a {n}-byte segment, over the "
                               f"{MAX_STORED_BYTES}-byte bound")
        off = self.dram.reserve(total)
        if off is None:
            self._demote_direct(kb, raw_segment(_gather_host(seg, ch.blocks), role=seg.role, layer=seg.layer,
                                                reason=seg.raw_reason), acc)
            return
        try:
            body = self.dram.view(off + HEADER_SIZE, n)
            dst = body.view(seg.dtype).reshape((len(ch.blocks),) + seg.block_shape)
            for j, b in enumerate(ch.blocks):
                _to_host(seg.view(b), dst[j])
            h = SegmentHeader(Format.RAW, seg.dtype, n, n, crc32c(body), role=seg.role, layer=seg.layer,
                              raw_reason=seg.raw_reason)
            pack_header_into(h, self.dram.view(off, HEADER_SIZE))
        except BaseException:
            self.dram.cancel(off, total)
            raise
        if self.dram.publish(kb, off, total, n, int(Format.RAW)) is not None:
            acc.admit(kb, n, total)
            self._count(self._codec_segments, "raw")
            if seg.raw_reason != RawReason.NONE:
                acc.raw[reason] = acc.raw.get(reason, 0) + 1
                self._count(self._raw, reason)

    def _batch_budget(self) -> int:
        """Encoded (workspace) bytes of one codec batch. With the GPU engine two batches share its workspace
        (one running while the host finishes the previous one), so each takes half of it."""
        budget = self._config.storage_codec_budget
        return max(budget // 2 - (1 << 20), 1 << 20) if self._gpu_codecs is not None else budget

    def _save_batches(self, eng: _Engine, batches: Iterable[list[tuple[ChunkBlocks, _Seg, bytes]]],
                      acc: "_SaveAcc") -> None:
        """Encode and admit ``batches`` (of :meth:`_save_items`) in order, pipelined: batch i+1 is formed,
        gathered and queued on the GPU before the host waits for batch i and publishes its segments."""
        _pipelined(batches, lambda b: self._save_submit(eng, b), lambda sb: self._save_finish(eng, sb, acc))

    def _save_submit(self, eng: _Engine, batch: list[tuple[ChunkBlocks, _Seg, bytes]]) -> "_SaveBatch":
        """Gather and encode one batch: queued on the GPU engine (finished by :meth:`_save_finish`), or
        done here with the host codecs."""
        gpu = self._gpu_codecs
        on_device = gpu is not None and eng.info.device != "host"
        sb = _SaveBatch(batch)
        if gpu is not None:
            sb.engine = engine = gpu.engine(eng.reg.rotation_seed)
        if on_device:
            sb.srcs, sb.buffer = _gather_batch([(seg, ch.blocks) for ch, seg, _ in batch],
                                               lambda n: engine.block_buffer(n, restore=False), engine.gather_blocks)
        else:
            sb.srcs = [_gather_device(seg, ch.blocks) if gpu else _gather_host(seg, ch.blocks) for ch, seg, _ in batch]
        sb.ws = sum(x.nbytes for x in sb.srcs)
        self._workspace_delta(sb.ws)

        def arena_region(nbytes: int) -> np.ndarray | None:
            off = self.dram.reserve(nbytes)
            if off is None:
                return None
            sb.regions.append((off, units_of(nbytes) * UNIT))
            return self.dram.view(off, nbytes)

        sink, sb.direct = self._ssd_direct_sink(eng, batch)
        t0 = time.perf_counter()
        try:
            if gpu is not None:
                sb.job = engine.encode_submit(
                    [gpu.item(x, seg) for x, (_, seg, _) in zip(sb.srcs, batch)],
                    out_region=arena_region if self.dram.arena.pinned else None, slot_align=UNIT, device_sink=sink)
            else:
                sb.blobs = [encode_segment(x, seg.codec, role=seg.role, layer=seg.layer)
                            for x, (_, seg, _) in zip(sb.srcs, batch)]
        except BaseException:
            self._save_abort(sb)
            raise
        sb.seconds = time.perf_counter() - t0
        return sb

    def _save_abort(self, sb: "_SaveBatch") -> None:
        """A batch that will not be published: its GPU work ends, its arena extents and workspace go back."""
        try:
            if sb.job is not None:
                sb.engine.encode_collect(sb.job)
        except Exception:  # already failing: the first error is the one reported
            pass
        finally:
            for off, n in sb.regions:
                self.dram.cancel(off, n)
            sb.regions.clear()
            self._workspace_delta(-sb.ws)
            sb.ws = 0
            sb.srcs, sb.buffer = [], None

    def _save_finish(self, eng: _Engine, sb: "_SaveBatch", acc: "_SaveAcc") -> None:
        """Wait for a submitted batch and admit its segments to DRAM (or hand them to the lower tier)."""
        t0 = time.perf_counter()
        try:
            blobs = sb.blobs if sb.job is None else sb.engine.encode_collect(sb.job)
        except BaseException:
            sb.job = None
            self._save_abort(sb)
            raise
        self._add(encode_seconds=sb.seconds + time.perf_counter() - t0, codec_batches=1,
                  ssd_direct_writes=len(sb.direct))
        self._workspace_delta(-sb.ws)
        sb.ws = 0
        sb.srcs, sb.buffer = [], None
        regions = sb.regions
        heads = sb.job.headers if sb.job is not None else [None] * len(blobs)
        used: list[tuple[int, int]] = []  # arena extents of the batch's regions, published in place
        todo: list[tuple[bytes, int, int, int, int]] = []  # ... by one publish_many
        reps = [0] * (max(_REP_NAMES) + 1)  # segments per Format value
        raws: collections.Counter[str] = collections.Counter()
        # The per-segment loop of every save: the region test is inlined (not _arena_offset) and the calls
        # are bound once, since at 512 KiB segments the host's work per segment bounds the throughput.
        base, admit = self.dram.arena.base_address, acc.admit
        lo, hi = min((o for o, _ in regions), default=0), max((o + n for o, n in regions), default=0)
        published = False
        try:
            for (ch, seg, kb), blob, h in zip(sb.batch, blobs, heads):
                h = h or parse_header(blob)
                fmt = int(h.format)
                reps[fmt] += 1
                if h.raw_reason:
                    raws[h.raw_reason.name.lower()] += 1
                n = len(blob)
                off = host_address(blob) - base if regions and type(blob) is memoryview and n else -1
                if lo <= off < hi and (len(regions) == 1 or any(o <= off < o + k for o, k in regions)):
                    used.append((off, units_of(n) * UNIT))
                else:
                    off = self.dram.reserve(n)
                    if off is None:
                        self._demote_direct(kb, blob, acc)
                        continue
                    try:
                        self.dram.view(off, n)[:] = np.frombuffer(blob, dtype=np.uint8)
                    except BaseException:
                        self.dram.cancel(off, n)
                        raise
                    # Published at once: the next reservation may have to evict it (a pool smaller than a batch).
                    if self.dram.publish(kb, off, n, h.original_length, fmt) is not None:
                        admit(kb, h.original_length, n)
                    continue
                todo.append((kb, off, n, h.original_length, fmt))
            # Set first: should publish_many fail part way, an extent it published must not go back to the pool.
            published = True
            done = self.dram.publish_many(todo)  # one lock round for the batch
            for (kb, _, n, logical, _), ok in zip(todo, done):
                if ok:
                    admit(kb, logical, n)
        finally:  # slot padding, batch metadata, fallback slots, what an error left unpublished: back to the pool
            if not published:  # nothing of the regions was published
                used.clear()
            for off, n in _gaps(regions, used):
                self.dram.cancel(off, n)
            regions.clear()
        with self._stat_lock:  # one lock round per batch, not two per segment
            for fmt, n in enumerate(reps):
                if n:
                    name = _REP_NAMES[fmt]
                    self._codec_segments[name] = self._codec_segments.get(name, 0) + n
            for name, n in raws.items():
                self._raw[name] = self._raw.get(name, 0) + n
        for name, n in raws.items():
            acc.raw[name] = acc.raw.get(name, 0) + n

    def _ssd_direct(self, eng: _Engine) -> bool:
        """The cuFile direct path applies: GPU pages, the GPU codec engine, and a lower tier that moves
        device memory itself (an SSD tier on the cuFile backend)."""
        return (self._gpu_codecs is not None and eng.info.device != "host"
                and bool(getattr(self.lower, "device_io", False)))

    def _ssd_direct_sink(self, eng: _Engine, batch: list[tuple[ChunkBlocks, _Seg, bytes]]):
        """For :meth:`_save_submit`: a ``device_sink`` for the GPU engine that writes the complete state
        groups of ``batch`` (chunks whose every (layer, role) segment is in this batch) from device
        memory straight to the SSD tier (``submit_device``), and the set it fills with the batch indices
        written that way; (None, empty set) when the direct path does not apply. Fragmented groups (a
        chunk split over batches, or partly cached already) and segments the engine coded on the host
        are not written here: DRAM demotes them through the tier's io_uring-style writeback as before.
        A dropped or failed direct write is left to that writeback too. DRAM admits every segment as usual."""
        written: set[int] = set()
        if not self._ssd_direct(eng):
            return None, written
        count = collections.Counter(ch.key for ch, _, _ in batch)
        nseg = len(eng.segs)
        complete = {i for i, (ch, _, _) in enumerate(batch) if count[ch.key] == nseg}
        if not complete:
            return None, written
        lower = self.lower

        def sink(i: int, segment) -> None:
            if i not in complete:
                return
            try:
                if lower.submit_device(ObjectKey.unpack(batch[i][2]), segment):
                    written.add(i)
            except Exception as e:  # the writeback path still has the segment: never fail the save
                log.warning("direct SSD write of %s failed: %s", ObjectKey.unpack(batch[i][2]), e)

        return sink, written

    def _demote_direct(self, kb: bytes, blob: bytes, acc: "_SaveAcc") -> None:
        """DRAM is full of leased objects: hand the segment to the lower tier, or drop it."""
        if self.lower is not None and self.lower.submit(ObjectKey.unpack(kb), bytes(blob)):
            acc.admit(kb, parse_header(blob).original_length, len(blob))
        else:
            acc.dropped += 1

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0,
                layers: Sequence[int] | None = None, caller: Caller | None = None) -> RestoreResult:
        """Write the chunks' cached KV into the given blocks. Every destination is validated first
        (:class:`RequestError`, nothing written); a missing or corrupt segment is a miss for its chunk.
        ``lease_id`` (from :meth:`lookup`, of this engine) is released when the restore ends, whether it
        succeeded or failed. ``layers`` restores only those layers' segments (an engine loading layer by
        layer); ``restored[i]`` then says whether every segment of those layers was written."""
        t0 = time.perf_counter()
        eng = self._enter(engine_id, caller)
        held = _Lease(engine_id)
        consume = 0  # the lookup lease this restore ends, once it is known to be this engine's
        try:
            if lease_id:
                with self._lock:
                    lease = self._leases.get(lease_id)
                    late = lease is None and self._expired.get(lease_id, 0) == engine_id
                if late:  # its lease expired: the restore takes its own hold below; evicted chunks miss
                    log.warning("engine %r restores under lease %d, which expired", engine_id, lease_id)
                elif lease is None or lease.engine_id != engine_id:
                    raise LeaseError(f"lease {lease_id} is not held by engine {engine_id!r}")
                else:
                    consume = lease_id
            self._check_chunks(eng, chunks, skips=True)
            segs = eng.segs
            if layers is not None:
                wanted = set(layers)
                if not wanted or not wanted <= {s.layer for s in eng.segs}:
                    raise RequestError(f"layers: {sorted(wanted)} are not all layers of engine {engine_id!r} "
                                       f"[{eng.info.layer_start}, {eng.info.layer_end})")
                segs = [s for s in eng.segs if s.layer in wanted]
            # A layer-by-layer load makes one call per layer: read ahead once, on the first layer's call.
            first = layers is None or eng.segs[0].layer in wanted
            keys = [[pack_key(eng.ns, ch.key, s.layer, s.role) for s in segs] for ch in chunks]
            reasons: dict[bytes, str] = {}
            pf_hits = self.dram.prefetch_hits  # a heuristic trigger: other requests may move it too
            tally = {"lower": 0}
            fresh: set[bytes] = set()  # keys whose source bytes were just validated in full (private copies)
            # SSD keys read into device memory and decoded there (the cuFile direct path), not sourced here.
            device: set[bytes] | None = set() if self._ssd_direct(eng) else None
            sources = self._acquire([k for ks in keys for k in ks], held, reasons, tally, fresh, device)
            if first and chunks and (tally["lower"] or self.dram.prefetch_hits != pf_hits):
                self._readahead(eng, chunks[-1].key, {ch.key for ch in chunks})
            # Phase 1: check every source against its destination; write nothing yet. Segments bound for
            # GPU pages through the GPU engine get their payload CRC32C checked there, before anything is
            # written to their destination (a mismatch is a miss, as here); their headers are verified in
            # full batch by batch while the GPU works on the previous batch (_decode_gpu). Here only their
            # size fields are read, so that a request its blocks cannot hold still fails before anything
            # is written; a header whose fields disagree is verified at once, to tell corruption (a miss)
            # from a wrong request (RequestError).
            gpu = self._gpu_codecs
            on_device = eng.info.device != "host"
            gpu_checks = gpu is not None and on_device
            bad: dict[int, str] = {}
            plan: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, memoryview]] = []  # whole segments
            deferred: list[tuple[int, _Seg, ChunkBlocks, None, memoryview, bytes]] = []  # headers checked later
            from_ssd: list[tuple[int, _Seg, ChunkBlocks, bytes]] = []
            for ci, (ch, ks) in enumerate(zip(chunks, keys)):
                for seg, kb in zip(segs, ks):
                    src = sources.get(kb)
                    if src is None and device and kb in device:
                        from_ssd.append((ci, seg, ch, kb))
                        continue
                    if src is None:
                        bad.setdefault(ci, reasons.get(kb, "missing"))
                        continue
                    want = len(ch.blocks) * seg.block_bytes
                    if gpu_checks and peek_source(src) == (seg.dtype_code, want):
                        deferred.append((ci, seg, ch, None, memoryview(src), kb))
                        continue
                    try:
                        # Arena extents (shared memory) are checked in full; lower-tier bytes were
                        # validated by the tier a moment ago and need no second payload CRC pass.
                        h = _verify_header(kb, src) if kb in fresh or gpu_checks else _verify(kb, src)
                    except SegmentError as e:
                        self._add(decode_failures=1)
                        bad[ci] = f"corrupt: {type(e).__name__}: {e}"
                        continue
                    if h.original_length != want or h.dtype != seg.dtype:
                        raise RequestError(
                            f"chunks[{ci}]: layer {seg.layer} {seg.role.name.lower()} holds {h.original_length} "
                            f"bytes of {h.dtype}, the {len(ch.blocks)} destination blocks take {want} bytes of "
                            f"{seg.dtype}")
                    plan.append((ci, seg, ch, h, memoryview(src)))
            # Phase 2: decode and scatter. With the GPU codec engine, coded segments go through it in
            # batches, and raw segments bound for GPU blocks in one upload per batch; the rest segment by
            # segment on the host.
            # The direct path's chunks first: one whose SSD record fails is marked bad before any other
            # segment of it is written.
            done_ssd, served_ssd = self._restore_ssd_device(eng, from_ssd, bad, reasons)
            segments = logical = stored = 0
            coded: list[tuple[int, _Seg, ChunkBlocks, "SegmentHeader | None", memoryview, bytes]] = deferred
            raw_dev: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, memoryview]] = []
            done: list[tuple[int, _Seg, ChunkBlocks, SegmentHeader, Exception | None]] = done_ssd
            for item in plan:
                ci, seg, ch, h, blob = item
                if ci in bad:
                    continue
                if gpu is not None and (h.format != Format.RAW or on_device):
                    coded.append(item + (b"",))
                elif on_device and h.format == Format.RAW:
                    raw_dev.append(item)
                else:
                    try:
                        self._write(seg, ch.blocks, h, blob)
                        done.append((ci, seg, ch, h, None))
                    except Exception as e:  # a codec failure on a checksummed segment: a miss, not a crash
                        done.append((ci, seg, ch, h, e))
            if coded:
                done += self._decode_gpu(eng, coded, bad)
            uploads: list = []  # pinned staging of raw uploads, freed once the stream is synchronised
            if raw_dev:
                done += self._upload_raw(raw_dev, uploads)
            if on_device:
                # Every copy into engine blocks was queued on this thread's CUDA stream: they must have
                # landed before the answer lets the engine read its pages.
                import cupy

                cupy.cuda.get_current_stream().synchronize()
                del uploads
            for ci, seg, ch, h, err in done:
                if err is not None:
                    log.warning("decode failed for chunk %s layer %d: %s", ch.key.hex(), seg.layer, err)
                    self._add(decode_failures=1)
                    bad.setdefault(ci, f"decode: {type(err).__name__}: {err}")
                    continue
                segments += 1
                logical += h.original_length
                stored += HEADER_SIZE + h.stored_length
            misses = [Miss(chunks[i].key, r) for i, r in sorted(bad.items())]
            self._add(misses=sum(1 for ks, ch in zip(keys, chunks) for k in ks if k not in sources and k not in served_ssd))
            dt = time.perf_counter() - t0
            self._add(restore_requests=1, restore_logical_bytes=logical, restore_stored_bytes=stored,
                      restore_seconds=dt)
            return RestoreResult(restored=[i not in bad for i in range(len(chunks))], misses=misses,
                                 segments=segments, logical_bytes=logical, stored_bytes=stored, seconds=dt)
        finally:
            self._drop_lease(held)
            if consume:
                with self._lock:
                    lease = self._leases.pop(consume, None)
                    eng.leases.discard(consume)
                if lease is not None:
                    self._drop_lease(lease)
            self._exit(eng)

    def _lease_dram(self, kbs: list[bytes], held: _Lease, out: dict) -> list[bytes]:
        """Lease the DRAM objects of ``kbs`` into ``held``, their views into ``out``; the keys not there."""
        missing = []
        for kb, f in zip(kbs, self.dram.lease(kbs)):
            if f is None:
                missing.append(kb)
                continue
            slot, gen, off, length = f
            held.entries.append((slot, gen))
            out[kb] = memoryview(self.dram.view(off, length))
        return missing

    def _acquire(self, kbs: list[bytes], held: _Lease, reasons: dict[bytes, str],
                 tally: dict[str, int] | None = None,
                 fresh: set[bytes] | None = None,
                 device: set[bytes] | None = None) -> dict[bytes, "memoryview | bytes"]:
        """Sources of ``kbs``: leased DRAM extents (recorded in ``held``), else verified lower-tier or peer
        bytes (readmitted to DRAM when they fit). Absent keys are left out; for keys whose bytes were bad,
        ``reasons`` says why. ``tally["lower"]`` counts the segments the lower tier served; ``fresh`` gets
        the keys whose bytes the lower tier validated in full (every CRC). With ``device`` (the cuFile
        direct path), keys DRAM lacks and the lower tier holds are not read here but put in ``device``
        (counted in ``tally["lower"]``): the caller reads them into device memory itself."""
        out: dict[bytes, memoryview | bytes] = {}
        missing = self._lease_dram(kbs, held, out)
        self._count(self._hits, "dram", len(kbs) - len(missing))
        if missing and device is not None and self.lower is not None:
            device.update(kb for kb in missing if self.lower.contains(ObjectKey.unpack(kb)))
            missing = [kb for kb in missing if kb not in device]
            if tally is not None:
                tally["lower"] += len(device)
        if missing and self.lower is not None:
            still = []
            okeys = [ObjectKey.unpack(k) for k in missing]
            claimed = [self.lower.contains(k) for k in okeys]
            reads = self.lower.read_many(okeys)
            for kb, got, held_there in zip(missing, reads, claimed):
                blob = self._checked_lower(kb, got, reasons)
                if blob is None:
                    if held_there and kb not in reasons:  # the tier dropped it as corrupt, or its read failed
                        reasons[kb] = "lower tier: record failed validation or could not be read"
                    still.append(kb)
                    continue
                self._admit(kb, blob)
                out[kb] = blob
                if tally is not None:
                    tally["lower"] += 1
                if fresh is not None:
                    fresh.add(kb)
            missing = still
        fetch_into = getattr(self.peers, "fetch_into", None)
        if missing and fetch_into is not None:
            # Zero-copy: the fetcher reserves arena extents, reads into them and publish() verifies in
            # place; what landed is then leased and served like any DRAM hit.
            try:
                fetch_into(self, [ObjectKey.unpack(k) for k in missing])
            except Exception as e:  # peers failing is a miss
                log.warning("peer fetch failed: %s", e)
            # Not delivered, failed verification, or already evicted again: still missing.
            still = self._lease_dram(missing, held, out)
            self._count(self._hits, "peer", len(missing) - len(still))
            missing = []
        if missing and self.peers is not None:
            try:
                got = self.peers.fetch([ObjectKey.unpack(k) for k in missing])
            except Exception as e:  # peers failing is a miss
                log.warning("peer fetch failed: %s", e)
                got = {}
            wanted = set(missing)
            for key, blob in got.items():
                kb = key.pack() if isinstance(key, ObjectKey) else b""
                if kb not in wanted or kb in out:
                    continue
                try:
                    _verify(kb, blob)
                except SegmentError as e:
                    log.warning("peer sent a bad segment for %s: %s", key, e)
                    self._add(decode_failures=1)
                    reasons[kb] = f"corrupt (peer): {type(e).__name__}: {e}"
                    continue
                self._count(self._hits, "peer")
                self._admit(kb, bytes(blob))
                out[kb] = bytes(blob)
        return out

    def _codec_batches(self, items: Iterable, nbytes: Callable, logical: "Callable | None" = None) -> Iterator[list]:
        """``items`` in the batches of a save or a restore: at most ``batch_segments``, and the codec budget
        in ``nbytes`` (one item may exceed it); with ``logical``, also at most ``BATCH_EXPANSION`` budgets of
        those bytes."""
        budget = self._batch_budget()
        batch: list = []
        size = total = 0
        for it in items:
            n = nbytes(it)
            m = logical(it) if logical is not None else 0
            if batch and (len(batch) >= self._config.batch_segments or size + n > budget
                          or total + m > BATCH_EXPANSION * budget):
                yield batch
                batch, size, total = [], 0, 0
            batch.append(it)
            size += n
            total += m
        if batch:
            yield batch

    def _decode_gpu(self, eng: _Engine, items: list, bad: dict[int, str]) -> list:
        """Segments through the GPU codec engine, in batches: ``(ci, seg, ch, h, blob, kb)`` items, ``h``
        None where the header is still to be verified (against key ``kb``, just before the item's batch is
        formed, so that this runs while the GPU works on the previous batch). A header that fails is a miss
        for its chunk (``bad[ci]``), whose later segments are then skipped. Answers ``(ci, seg, ch, h, error
        or None)`` per segment decoded; the GPU blocks are written when this returns, except those of
        irregular layouts, queued on the current stream (the caller synchronises it)."""

        def verified() -> Iterator[tuple]:
            for ci, seg, ch, h, blob, kb in items:
                if ci in bad:
                    continue
                if h is None:
                    try:
                        h = _verify_header(kb, blob)
                        if h.original_length != len(ch.blocks) * seg.block_bytes or h.dtype != seg.dtype:
                            # phase 1 read other size fields: the bytes changed under the lease
                            raise SegmentError(f"header changed: {h.original_length} bytes of {h.dtype}")
                    except SegmentError as e:
                        self._add(decode_failures=1)
                        bad[ci] = f"corrupt: {type(e).__name__}: {e}"
                        continue
                yield ci, seg, ch, h, blob

        # One engine, the registration's: a decode takes the rotation seed from each segment's header, so
        # exact and TurboQuant segments share batches.
        seed = eng.reg.rotation_seed
        jobs = self._codec_batches(verified(), lambda it: _decode_bound(it[3]), lambda it: it[3].original_length)
        # Pipelined: batch i+1 is uploaded and decoding on the GPU while the host takes batch i's verdicts
        # and queues its block copies (one stream: they run after it). A temporary freed meanwhile goes back
        # to that stream's pool, so only later work on the stream reuses it.
        copies: list = []  # the event after each batch's block copies
        out = []

        def end(started: tuple) -> list:
            part, ev = self._decode_end(*started)
            if ev is not None:
                copies.append(ev)
            return part

        try:
            for part in _pipelined(jobs, lambda batch: self._decode_start(seed, batch), end):
                out += part
        finally:
            if copies:
                copies[-1].synchronize()  # every block copy queued so far has run (one stream, in order)
        return out

    def _decode_start(self, seed: int, batch: list) -> tuple:
        ws = sum(h.original_length for _, _, _, h, _ in batch)
        self._workspace_delta(ws)
        t0 = time.perf_counter()
        try:
            db = self._gpu_codecs.decode_submit([(seg, ch.blocks, blob, h) for _, seg, ch, h, blob in batch], seed,
                                                [self._pinned(blob) for *_, blob in batch])
        except Exception as e:  # the engine failed as a whole: every segment of the batch misses
            db = e
        return batch, db, ws, time.perf_counter() - t0

    def _decode_end(self, batch: list, db, ws: int, seconds: float) -> tuple[list, object]:
        t0 = time.perf_counter()
        ev = None
        try:
            if isinstance(db, Exception):
                errs = [db] * len(batch)
            else:
                try:
                    errs, ev = self._gpu_codecs.decode_finish(db)
                except Exception as e:
                    errs = [e] * len(batch)
        finally:
            self._workspace_delta(-ws)
        self._add_per_segment("decode_seconds", seconds + time.perf_counter() - t0, len(batch))
        return [(ci, seg, ch, h, err) for (ci, seg, ch, h, _), err in zip(batch, errs)], ev

    def _restore_ssd_device(self, eng: _Engine, items: list[tuple[int, _Seg, ChunkBlocks, bytes]],
                            bad: dict[int, str], reasons: dict[bytes, str]) -> tuple[list, set[bytes]]:
        """The cuFile direct path of a restore: ``(ci, seg, chunk, key)`` items whose segments only the SSD
        tier holds and whose destinations are GPU pages. Their records are read into device memory
        (``read_many_device``), the record headers checked on the host, and the GPU engine checks each
        payload's CRC32C and decodes it from where it lies, into a device temporary; a chunk's temporaries
        are scattered into its blocks only when every one of its segments decoded, so a chunk with a bad
        record is a miss (``bad[ci]``, the lower tier's reason) with nothing written to its blocks. Chunks
        already in ``bad`` are skipped. Works in windows of whole chunks within the codec budget (decoded
        and record bytes). Raises :class:`RequestError`, before reading anything, when a record's size does
        not fit its destination blocks.

        These segments are not readmitted to DRAM: that would bring every one back to the host, the
        bounce this path exists to avoid (a later lookup promotes them through the host path as usual).
        Answers the ``done`` entries of the segments written (their copies into GPU blocks queued on the
        current stream) and their keys."""
        if not items:
            return [], set()
        import cupy

        from .tiers.ssd.record import record_length

        items = [it for it in items if it[0] not in bad]
        info = self.lower.describe([ObjectKey.unpack(kb) for *_, kb in items])
        by_chunk: dict[int, list[tuple[_Seg, ChunkBlocks, bytes, int, int]]] = {}
        for (ci, seg, ch, kb), got in zip(items, info):
            if got is None:  # evicted or invalidated since _acquire saw it
                bad.setdefault(ci, reasons.get(kb, "missing"))
                continue
            original, seg_len = got
            want = len(ch.blocks) * seg.block_bytes
            if original != want:
                raise RequestError(
                    f"chunks[{ci}]: layer {seg.layer} {seg.role.name.lower()} holds {original} bytes, the "
                    f"{len(ch.blocks)} destination blocks take {want} bytes")
            by_chunk.setdefault(ci, []).append((seg, ch, kb, original, seg_len))
        budget = self._config.storage_codec_budget
        windows: list[list[int]] = []
        dec = rec = 0
        for ci, group in by_chunk.items():
            if ci in bad:
                continue
            d, r = sum(g[3] for g in group), sum(record_length(g[4]) for g in group)
            if not windows or dec + d > budget or rec + r > budget:
                windows.append([])
                dec = rec = 0
            windows[-1].append(ci)
            dec, rec = dec + d, rec + r
        seed = eng.reg.rotation_seed
        done: list = []
        served: set[bytes] = set()
        for window in windows:
            flat = [(ci, seg, ch, kb, original, seg_len) for ci in window
                    for seg, ch, kb, original, seg_len in by_chunk[ci]]
            tmps = [cupy.empty(f[4], dtype=cupy.uint8) for f in flat]
            errors: dict[int, Exception] = {}
            ws = sum(f[4] for f in flat)
            self._workspace_delta(ws)

            def sink(batch: list) -> list[int]:
                t0 = time.perf_counter()
                try:
                    errs = self._gpu_codecs.decode_device([v for _, v in batch], [tmps[j] for j, _ in batch], seed)
                except Exception as e:  # the engine failed as a whole: the window misses, nothing invalidated
                    errs = [e] * len(batch)
                self._add_per_segment("decode_seconds", time.perf_counter() - t0, len(batch))
                rejected = []
                for (j, _), err in zip(batch, errs):
                    if err is None:
                        continue
                    errors[j] = err
                    if isinstance(err, SegmentError):  # the payload (CRC32C) or its header: the record is corrupt
                        rejected.append(j)
                return rejected

            try:
                verdicts = self.lower.read_many_device([ObjectKey.unpack(f[3]) for f in flat], sink, max_bytes=budget)
                failed: dict[int, str] = {}
                for j, ((ci, seg, ch, kb, _, _), why) in enumerate(zip(flat, verdicts)):
                    err = errors.get(j)
                    if err is not None and not isinstance(err, SegmentError):  # a decode failure, not the record
                        log.warning("decode failed for chunk %s layer %d: %s", ch.key.hex(), seg.layer, err)
                        self._add(decode_failures=1)
                        failed.setdefault(ci, f"decode: {type(err).__name__}: {err}")
                    elif why == "absent":
                        failed.setdefault(ci, reasons.get(kb, "missing"))
                    elif why is not None or err is not None:
                        failed.setdefault(ci, "lower tier: record failed validation or could not be read")
                for j, (ci, seg, ch, kb, original, seg_len) in enumerate(flat):
                    if ci in failed:
                        continue
                    src = tmps[j].view(cupy_dtype(seg.dtype)).reshape((len(ch.blocks),) + seg.block_shape)
                    seg.scatter(ch.blocks, src)
                    served.add(kb)
                    # restore() counts sizes from the header; these two fields are what it reads.
                    done.append((ci, seg, ch, _Sizes(original, seg_len - HEADER_SIZE), None))
                for ci, why in failed.items():
                    bad.setdefault(ci, why)
            finally:
                self._workspace_delta(-ws)
        self._count(self._hits, "lower", len(served))
        self._add(ssd_direct_reads=len(served))
        return done, served

    def _arena_offset(self, blob) -> int | None:
        """The arena offset of ``blob`` when it is a view of the arena, else None."""
        if not isinstance(blob, memoryview) or not len(blob):
            return None
        off = host_address(blob) - self.dram.arena.base_address
        return off if 0 <= off and off + len(blob) <= self.dram.arena.size else None

    def _pinned(self, blob) -> bool:
        """``blob`` is a view of the arena, and the arena is pinned (the GPU copies from it directly)."""
        return self.dram.arena.pinned and self._arena_offset(blob) is not None

    def _upload_raw(self, items: list, keep: list) -> list:
        """Raw segments into GPU blocks: per batch, the payloads are packed into one pinned buffer, sent
        with one host-to-device copy, then scattered on the device, all queued on the current stream.
        The pinned buffers go to ``keep``: the caller holds them until it has synchronised the stream."""
        import cupy

        out = []
        for batch in self._codec_batches(items, lambda it: it[3].stored_length):
            total = sum(h.stored_length for _, _, _, h, _ in batch)
            res: list = []
            self._workspace_delta(2 * total)
            try:
                host = np.frombuffer(cupy.cuda.alloc_pinned_memory(total), np.uint8, total)
                keep.append(host)
                pos = 0
                for _, _, _, h, blob in batch:
                    host[pos:pos + h.stored_length] = np.frombuffer(blob, np.uint8, h.stored_length, HEADER_SIZE)
                    pos += h.stored_length
                dev = cupy.empty(total, dtype=cupy.uint8)
                stream = cupy.cuda.get_current_stream()
                cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, total,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                pos = 0
                for ci, seg, ch, h, _ in batch:
                    src = dev[pos:pos + h.stored_length].view(cupy_dtype(seg.dtype))
                    seg.scatter(ch.blocks, src.reshape((len(ch.blocks),) + seg.block_shape))
                    res.append((ci, seg, ch, h, None))
                    pos += h.stored_length
            except Exception as e:  # a CUDA failure: the whole batch misses
                res = [(ci, seg, ch, h, e) for ci, seg, ch, h, _ in batch]
            finally:
                self._workspace_delta(-2 * total)
            out += res
        return out

    def _write(self, seg: _Seg, blocks: list[int], h: SegmentHeader, blob: memoryview) -> None:
        """Decode a verified segment into the chunk's destination blocks on the host (GPU blocks get
        their copies queued on the current stream)."""
        payload = blob[HEADER_SIZE:HEADER_SIZE + h.stored_length]
        if h.format == Format.RAW:
            flat = np.frombuffer(payload, dtype=h.dtype)
        else:
            t0 = time.perf_counter()
            flat = decode_payload(h, payload)
            self._workspace_delta(flat.nbytes)
            self._add(decode_seconds=time.perf_counter() - t0)
        try:
            src = flat.view(seg.dtype).reshape((len(blocks),) + seg.block_shape)
            if not seg.on_host:  # GPU pages without the GPU codec engine
                import cupy

                src = cupy.asarray(src.view(cupy_dtype(seg.dtype)))
            seg.scatter(blocks, src)
        finally:
            if h.format != Format.RAW:
                self._workspace_delta(-flat.nbytes)

    def release(self, lease_id: int, *, engine_id: str | None = None, caller: Caller | None = None) -> None:
        """Drop a lease from :meth:`lookup` or :meth:`lease_objects`. With ``caller``, only a lease of
        ``engine_id`` that the caller may act for (never a peer's). Raises :class:`LeaseError`."""
        with self._lock:
            if caller is not None:
                eng = self._engines.get(engine_id or "")
                if eng is None or eng.closing:
                    raise UnknownEngine(f"no engine {engine_id!r} is registered")
                authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
                mine = self._leases.get(lease_id)
                if (mine.engine_id if mine is not None else self._expired.get(lease_id)) != engine_id:
                    raise LeaseError(f"lease {lease_id} is not held by engine {engine_id!r}")
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                if lease_id in self._expired:  # expired already: nothing left to drop
                    return
                raise LeaseError(f"unknown lease {lease_id}")
            eng = self._engines.get(lease.engine_id) if lease.engine_id else None
            if eng is not None:
                eng.leases.discard(lease_id)
        self._drop_lease(lease)

    def _drop_lease(self, lease: _Lease) -> None:
        if lease.chunks:
            self.dram.unpin_chunks(lease.chunks)
            lease.chunks = []
        if lease.entries:
            self.dram.unlease(lease.entries)
            lease.entries = []

    # -- admin ---------------------------------------------------------------------------------------

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False, caller: Caller | None = None) -> InvalidateResult:
        """Drop objects from every tier: exact ``keys``; ``chunks`` of ``engine_id`` or ``namespace``;
        everything of a namespace or an engine's namespace; or ``all``. Leased objects are hidden at once
        and freed when their leases drain. Answers per-tier object counts and stored bytes. With
        ``caller`` (an engine, not the operator) only ``engine_id`` (optionally narrowed to ``chunks``) of an
        engine the caller may act for: any other selector raises
        :class:`~orbitkv_fs.access.AdminRequired`."""
        if sum(x is not None for x in (keys, namespace, engine_id)) + bool(all) != 1:
            raise RequestError("invalidate needs exactly one of keys, namespace, engine_id or all")
        if namespace is not None and len(namespace) != 16:
            raise RequestError("a namespace is 16 bytes")
        if chunks is not None and namespace is None and engine_id is None:
            raise RequestError("chunks go with namespace or engine_id")
        if caller is not None and engine_id is None:
            raise AdminRequired("invalidating keys, a namespace or everything is an admin act (the admin "
                                "token); an engine invalidates its own namespace by its engine_id")
        if engine_id is not None:
            with self._lock:
                eng = self._engines.get(engine_id)
                if eng is None:
                    raise UnknownEngine(f"no engine {engine_id!r} is registered")
                if caller is not None:
                    authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
                namespace = eng.ns
        with self._stat_lock:
            self._inval_epoch += 1  # before DRAM is swept: see _prefetched()
        lower = TierCounts()
        if keys is not None:
            packed = {k.pack() for k in keys}
            d = self.dram.invalidate(packed.__contains__)
            if self.lower is not None:
                lower = self.lower.invalidate(keys=list(keys))
        elif namespace is not None and chunks is not None:
            wanted = {namespace + c for c in chunks}
            d = self.dram.invalidate(lambda k: k[:32] in wanted)
            if self.lower is not None:  # also chunks it no longer lists: a restart must not revive them
                lower = self.lower.invalidate(namespace=namespace, chunks=list(chunks))
        elif namespace is not None:
            d = self.dram.invalidate(lambda k: k[:16] == namespace)
            if self.lower is not None:
                lower = self.lower.invalidate(namespace=namespace)
        else:
            d = self.dram.invalidate(lambda k: True)
            if self.lower is not None:
                lower = self.lower.invalidate(all=True)
        return InvalidateResult(dram=TierCounts(*d), lower=lower)

    def stats(self) -> ManagerStats:
        dram = self.dram
        with dram.lock:
            used = dram.used_bytes
            resident = {_REP_NAMES[r]: b for r, b in dram.resident_bytes.items() if b}
            objects = len(dram.index)
            logical = dram.resident_logical
            evictions, evicted, demoted = dram.evictions, dram.evicted_bytes, dram.demoted
            pf_hits, pf_wasted = dram.prefetch_hits, dram.prefetch_wasted
            reserved = dram.reserved_bytes
            leases = dram.leases_active + dram.pins_active
            leased = dram.leased_bytes
        lower_stats: dict[str, float] = {}
        gpu = self._gpu_codecs.stats() if self._gpu_codecs is not None else {}

        def per_worker(name: str) -> dict[str, int]:
            return {w: int(gpu.get(f"{w}_{name}", 0)) for w in ("save", "restore")} if gpu else {}

        res_objects = {"dram": objects}
        res_bytes = {"dram": resident}
        if self.lower is not None:
            lower_stats = {k: float(v) for k, v in self.lower.stats().items()}
        with self._lock:
            engines = sum(1 for e in self._engines.values() if not e.closing)
            inflight = self._inflight
        with self._stat_lock:
            c = dict(self._c)
            return ManagerStats(
                engines=engines, pool_capacity_bytes=dram.capacity, pool_used_bytes=used,
                resident_objects=res_objects, resident_bytes=res_bytes, resident_logical_bytes=logical,
                hits=dict(self._hits), misses=int(c["misses"]), lookups=int(c["lookups"]),
                lookup_chunks_hit=int(c["lookup_chunks_hit"]), evictions=evictions, evicted_bytes=evicted,
                demoted=demoted, save_requests=int(c["save_requests"]),
                save_logical_bytes=int(c["save_logical_bytes"]), save_stored_bytes=int(c["save_stored_bytes"]),
                save_seconds=c["save_seconds"], restore_requests=int(c["restore_requests"]),
                restore_logical_bytes=int(c["restore_logical_bytes"]),
                restore_stored_bytes=int(c["restore_stored_bytes"]), restore_seconds=c["restore_seconds"],
                codec_batches=int(c["codec_batches"]), codec_segments=dict(self._codec_segments),
                encode_seconds=c["encode_seconds"], decode_seconds=c["decode_seconds"], raw_segments=dict(self._raw),
                decode_failures=int(c["decode_failures"]), dropped_segments=int(c["dropped_segments"]),
                reserved_bytes=reserved, leases_active=leases, leased_bytes=leased,
                workspace_bytes=self._workspace, inflight_requests=inflight, lower=lower_stats,
                durations={name: h.snapshot() for name, h in self._durations.items()},
                gpu_workspace_bytes=int(gpu.get("save_workspace_bytes", 0) + gpu.get("restore_workspace_bytes", 0)),
                gpu_workspace_grows=int(gpu.get("save_workspace_grows", 0) + gpu.get("restore_workspace_grows", 0)),
                gpu_batches=per_worker("batches"), gpu_segments=per_worker("segments"),
                gpu_cpu_fallbacks=per_worker("cpu_fallbacks"),
                prefetch_segments=int(c["prefetch_segments"]), prefetch_bytes=int(c["prefetch_bytes"]),
                prefetch_hits=pf_hits, prefetch_wasted=pf_wasted, engines_reaped=int(c["engines_reaped"]),
                leases_expired=int(c["leases_expired"]), ssd_direct_writes=int(c["ssd_direct_writes"]),
                ssd_direct_reads=int(c["ssd_direct_reads"]))

    def flush_dram(self) -> FlushResult:
        """Demote every unleased DRAM object to the lower tier and wait for its writeback; DRAM keeps
        nothing it could hand over (without a lower tier the objects are simply dropped)."""
        sub = [0, 0]
        drop = [0, 0]
        while True:  # in slices, so a flush never holds a copy of the whole pool
            objs, leased = self.dram.drain(64 << 20)
            if not objs:
                break
            for key, blob in objs:
                # A flush hands over everything at once: wait for room in the lane rather than drop.
                ok = self.lower is not None and self.lower.submit(key, blob, timeout=60.0)
                t = sub if ok else drop
                t[0] += 1
                t[1] += len(blob)
        if self.lower is not None:
            self.lower.flush()
        return FlushResult(submitted=TierCounts(*sub), dropped=TierCounts(*drop), skipped_leased=leased)

    def list_objects(self, namespace: bytes | None = None, prefix: str = "", limit: int = 1000,
                     cursor: str | None = None) -> ObjectPage:
        """Page through cached objects (DRAM, then the lower tier), in packed-key order; ``prefix`` is a
        hex prefix of the chunk key. Lower-tier rows carry format "", original length 0 and the tier's
        stored bytes (its listing does not read headers)."""
        if not 0 < limit <= 100_000:
            raise RequestError("limit must be in 1..100000")
        prefix = prefix.lower()
        if any(ch not in "0123456789abcdef" for ch in prefix):
            raise RequestError("prefix must be hex")
        tier, after = "dram", ""
        if cursor:
            tier, _, after = cursor.partition(":")
            if tier not in ("dram", "lower"):
                raise RequestError(f"bad cursor {cursor!r}")
        out: list[ObjectInfo] = []
        last = ""

        def want(kb: bytes) -> bool:
            return (namespace is None or kb[:16] == namespace) and kb[16:32].hex().startswith(prefix) \
                and kb.hex() > after

        if tier == "dram":
            for kb, rep, logical, length, gen in self.dram.listing():
                if not want(kb):
                    continue
                if len(out) == limit:
                    return ObjectPage(out, f"dram:{last}")
                out.append(ObjectInfo(str(ObjectKey.unpack(kb)), "dram", _REP_NAMES[rep], logical,
                                      length - HEADER_SIZE, gen))
                last = kb.hex()
            after = ""
        if self.lower is not None:
            for kb, n in sorted((k.pack(), n) for k, n in self.lower.iter_objects(namespace)):
                if not want(kb):
                    continue
                if len(out) == limit:
                    return ObjectPage(out, f"lower:{last}")
                out.append(ObjectInfo(str(ObjectKey.unpack(kb)), "lower", "", 0, n))
                last = kb.hex()
        return ObjectPage(out, None)

    def config(self) -> ManagerConfig:
        return self._config

    # -- peers ---------------------------------------------------------------------------------------

    def set_peer_fetcher(self, fetcher: PeerFetcher | None) -> None:
        self.peers = fetcher

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[ObjectExtent | None]]:
        """Lease the DRAM extents of ``keys`` (None where no tier has one DRAM can hold); release with
        :meth:`release`. Keys only the lower tier holds are first read back into DRAM (verified, at most
        :data:`_PEER_READMIT_SEGMENTS` per call), so peers are served SSD data too."""
        kbs = [k.pack() for k in keys]
        if self.lower is not None:
            self._readmit([(k, kb) for k, kb in zip(keys, kbs) if not self.dram.contains(kb)])
        lease = _Lease(None)
        out: list[ObjectExtent | None] = []
        for f in self.dram.lease(kbs):
            if f is None:
                out.append(None)
                continue
            slot, gen, off, length = f
            lease.entries.append((slot, gen))
            out.append(ObjectExtent(off, length, gen))
        if not lease.entries:
            return 0, out
        with self._lock:
            lease_id = self._hand_out(lease)
        return lease_id, out

    def _readmit(self, wanted: list[tuple[ObjectKey, bytes]]) -> None:
        """Read ``wanted`` objects the lower tier holds back into DRAM (bounded), for peers."""
        held = [(k, kb) for k, kb in wanted if self.lower.contains(k)][:_PEER_READMIT_SEGMENTS]
        if not held:
            return
        for (k, kb), blob in zip(held, self.lower.read_many([k for k, _ in held])):
            blob = self._checked_lower(kb, blob)
            if blob is not None:
                self._admit(kb, blob)

    def read_object(self, key: ObjectKey) -> bytes | None:
        """A verified copy of ``key``'s segment from DRAM or the lower tier (no peers, no promotion)."""
        kb = key.pack()
        blob = self.dram.read(kb)
        if blob is not None:
            try:
                _verify(kb, blob)
                return blob
            except SegmentError:
                self._add(decode_failures=1)
        if self.lower is not None:
            return self._read_lower(kb)
        return None

    def arena_info(self) -> ArenaInfo:
        a = self.dram.arena
        return ArenaInfo(path=a.path, size=a.size, base_address=a.base_address, pinned=a.pinned)

    def reserve(self, nbytes: int) -> ObjectExtent:
        """Reserve an arena extent (evicting if needed) for bytes a transfer writes in place; its
        ``generation`` is the reservation id. Counts in ``reserved_bytes`` until published or aborted."""
        if not HEADER_SIZE <= nbytes <= HEADER_SIZE + MAX_STORED_BYTES:
            raise RequestError(f"cannot reserve {nbytes} bytes for one segment")
        off = self.dram.reserve(nbytes)
        if off is None:
            raise PoolExhausted(f"no room for {nbytes} bytes: the pool is full of leased objects")
        rid = next(self._res_ids)
        with self._lock:
            self._reservations[rid] = (off, nbytes)
        return ObjectExtent(off, nbytes, rid)

    def publish(self, reservation: ObjectExtent, key: ObjectKey) -> bool:
        """Verify the segment written into ``reservation`` (header, key's layer/role, CRC) and publish it
        under ``key``; on failure the extent is freed and False returned."""
        with self._lock:
            res = self._reservations.pop(reservation.generation, None)
        if res is None or res != (reservation.offset, reservation.length):
            raise RequestError(f"unknown reservation {reservation.generation}")
        off, n = res
        kb = key.pack()
        try:
            h = _verify(kb, memoryview(self.dram.view(off, n)))
        except SegmentError as e:
            log.warning("transferred segment for %s is bad: %s", key, e)
            self._add(decode_failures=1)
            self.dram.cancel(off, n)
            return False
        return self.dram.publish(kb, off, n, h.original_length, int(h.format)) is not None

    def abort(self, reservation: ObjectExtent) -> None:
        with self._lock:
            res = self._reservations.pop(reservation.generation, None)
        if res is None:
            raise RequestError(f"unknown reservation {reservation.generation}")
        self.dram.cancel(*res)

    def close(self) -> None:
        """Unregister every engine, close the lower tier, unmap and unlink the arena."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._engines)
            housekeeper = self._housekeeper
        self._housekeeper_stop.set()
        if housekeeper is not None:
            housekeeper.join()
        for engine_id in ids:
            try:
                self.unregister_engine(engine_id)
            except UnknownEngine:
                pass
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            self._drop_lease(lease)
        if self.lower is not None:
            self.lower.close()
        if self._gpu_codecs is not None:
            self._gpu_codecs.close()
        self.dram.close()

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DURATIONS = {"save_seconds": "save", "restore_seconds": "restore", "encode_seconds": "encode",
              "decode_seconds": "decode"}

_COUNTERS = ("misses", "lookups", "lookup_chunks_hit", "save_requests", "save_logical_bytes", "save_stored_bytes",
             "save_seconds", "restore_requests", "restore_logical_bytes", "restore_stored_bytes",
             "restore_seconds", "codec_batches", "encode_seconds", "decode_seconds", "decode_failures",
             "dropped_segments", "prefetch_segments", "prefetch_bytes", "engines_reaped", "leases_expired",
             "ssd_direct_writes", "ssd_direct_reads")


class _Sizes(msgspec.Struct, frozen=True):
    """The sizes of a segment decoded on the direct path (its header stayed on the device)."""

    original_length: int
    stored_length: int


def _housekeep(manager: "weakref.ref[Manager]", stop: threading.Event, interval: float) -> None:
    """The housekeeping thread: every ``interval`` seconds, reap the Manager's dead engines and drop its
    expired leases. Holds the Manager only during a round, so a Manager dropped without
    :meth:`Manager.close` can still go."""
    while not stop.wait(interval):
        m = manager()
        if m is None:
            return
        for job in (m._reap_dead, m._expire_leases):
            try:
                job()
            except Exception:  # the thread must outlive one bad round
                log.exception("housekeeping: %s failed", job.__name__)
        del m


class _SaveAcc:
    __slots__ = ("admitted", "logical", "stored", "raw", "dropped", "present")

    def __init__(self) -> None:
        self.admitted: set[bytes] = set()
        self.logical = self.stored = self.dropped = self.present = 0
        self.raw: dict[str, int] = {}

    def admit(self, kb: bytes, logical: int, stored: int) -> None:
        self.admitted.add(kb)
        self.logical += logical
        self.stored += stored



class _DecodeBatch:
    """One restore batch between :meth:`_GpuCodecs.decode_submit` and :meth:`_GpuCodecs.decode_finish`."""

    __slots__ = ("engine", "items", "staged", "temp", "dsts", "job")

    def __init__(self, engine, items: list) -> None:
        self.engine = engine
        self.items = items
        self.staged: list[tuple[int, int]] = []  # (item, offset in temp): decoded there, then copied to blocks
        self.temp = None  # device buffer on the restore stream: alive until the block copies have run
        self.dsts: list = []
        self.job = None


class _SaveBatch:
    """One save batch between :meth:`Manager._save_submit` and :meth:`Manager._save_finish`."""

    __slots__ = ("batch", "srcs", "buffer", "ws", "regions", "direct", "engine", "job", "blobs", "seconds")

    def __init__(self, batch: list[tuple[ChunkBlocks, _Seg, bytes]]) -> None:
        self.batch = batch
        self.srcs: list = []  # gathered sources ...
        self.buffer = None  # ... and the device buffer behind the spans: alive until the GPU has read them
        self.ws = 0  # workspace bytes counted for it
        self.regions: list[tuple[int, int]] = []  # arena extents the GPU engine writes segments into
        self.direct: set[int] = set()  # batch indices written to the SSD from device memory
        self.engine = None  # the GPU codec engine ...
        self.job = None  # ... and its EncodeJob
        self.blobs: list = []  # host codecs: the segments
        self.seconds = 0.0


class _GpuCodecs:
    """The GPU codec engine (:mod:`orbitkv_fs.gpu`) behind the two calls the pipeline makes: encode a
    batch of device arrays into segments, decode one segment into a chunk's blocks. One engine per
    rotation seed (the engine's TurboQuant signs depend on it)."""

    def __init__(self, budget: int) -> None:
        from .gpu import EncodeItem, GpuCodecEngine
        from .gpu.module import check_device

        check_device()
        self._item = EncodeItem
        self._cls = GpuCodecEngine
        self._budget = budget
        self._engines: dict[int, object] = {}
        self._lock = threading.Lock()

    def engine(self, seed: int):
        """The engine of rotation seed ``seed`` (made on first use)."""
        with self._lock:
            e = self._engines.get(seed)
            if e is None:
                e = self._engines[seed] = self._cls(budget_bytes=self._budget, seed=seed)
            return e

    def item(self, array, seg: _Seg):
        """The engine's encode item for ``array`` (a gathered segment source) of ``seg``."""
        return self._item(array, seg.codec_name, seg.role, seg.layer, seg.dtype, seg.raw_reason)

    def decode_device(self, segments: list, destinations: list, seed: int) -> list:
        """``decode_batch`` of segments in device memory into device destinations (complete on return)."""
        return self.engine(seed).decode_batch(segments, destinations)

    def decode_submit(self, items: list[tuple[_Seg, list[int], memoryview, SegmentHeader]], seed: int,
                      pinned: Sequence[bool] | None = None) -> "_DecodeBatch":
        """Start decoding ``(seg, blocks, segment bytes, its verified header)`` items with one
        ``decode_submit``; :meth:`decode_finish` then scatters them into their chunks' blocks. ``pinned[i]``:
        item i's bytes are in pinned memory (the arena) and go to the GPU from there."""
        from .gpu.engine import DeviceSpan

        # A chunk whose blocks are one contiguous stretch of GPU pages is decoded straight into them (the
        # engine leaves a destination untouched when its segment fails the CRC32C check). The others land
        # in one temporary and go to their blocks with one block-copy launch for the batch (GPU pages), or
        # a copy per segment (host pages, irregular layouts: these get cupy views of the temporary).
        engine = self.engine(seed)
        db = _DecodeBatch(engine, items)
        dsts: list = [None] * len(items)
        size = 0
        for i, (seg, blocks, _, _) in enumerate(items):
            dsts[i] = _device_run(seg, blocks)
            if dsts[i] is None:
                db.staged.append((i, size))
                size = -(-(size + len(blocks) * seg.block_bytes) // _SLICE_ALIGN) * _SLICE_ALIGN
        if db.staged:
            db.temp = engine.block_buffer(size, restore=True)
            addr = int(db.temp.data.ptr)
            for i, pos in db.staged:
                seg, blocks, _, _ = items[i]
                n = len(blocks) * seg.block_bytes
                dsts[i] = (DeviceSpan(addr + pos, n) if seg.copy is not None else
                           db.temp[pos:pos + n].view(cupy_dtype(seg.dtype)).reshape((len(blocks),) + seg.block_shape))
        db.dsts = dsts
        db.job = engine.decode_submit([blob for _, _, blob, _ in items], dsts, pinned=pinned,
                                      headers=[h for *_, h in items])
        return db

    def decode_finish(self, db: "_DecodeBatch") -> tuple[list, object]:
        """Wait for a submitted decode and queue each decoded item's copy into its blocks: the error (or None)
        per item, and the CUDA event after the block copies (None when none were queued). Host pages and
        irregular GPU layouts are written here (the latter by cupy on the current stream, which the caller
        synchronises)."""
        errs: list = list(db.engine.decode_collect(db.job))
        kernel: list[tuple[_Seg, list[int], int]] = []
        addr = int(db.temp.data.ptr) if db.temp is not None else 0
        for i, pos in db.staged:
            seg, blocks, _, _ = db.items[i]
            if errs[i] is not None:
                continue
            if seg.copy is not None:
                kernel.append((seg, blocks, addr + pos))
                continue
            try:
                if seg.on_host:  # host pages (maybe strided: no get(out=))
                    seg.scatter(blocks, db.dsts[i].get().view(seg.dtype))
                else:
                    seg.scatter(blocks, db.dsts[i])
            except Exception as e:
                errs[i] = e
        return errs, (db.engine.scatter_blocks(_block_table(kernel, gather=False)) if kernel else None)

    def stats(self) -> dict[str, int]:
        """The engines' counters (``GpuCodecEngine.stats`` names), summed over rotation seeds."""
        out: dict[str, int] = {}
        with self._lock:
            engines = list(self._engines.values())
        for e in engines:
            for k, v in e.stats.items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def close(self) -> None:
        with self._lock:
            for e in self._engines.values():
                e.close()
            self._engines.clear()


def _gather_host(seg: _Seg, blocks: list[int]) -> np.ndarray:
    """The chunk's blocks of ``seg`` as one contiguous host array of the segment's dtype."""
    x = seg.gather(blocks)
    return x if isinstance(x, np.ndarray) else x.get().view(seg.dtype)


def _gather_device(seg: _Seg, blocks: list[int]):
    """The chunk's blocks of ``seg`` as one contiguous cupy array (host pages are uploaded)."""
    import cupy

    x = seg.gather(blocks)
    if isinstance(x, np.ndarray):
        return cupy.asarray(x.view(cupy_dtype(x.dtype)))
    return x


#: A codec batch's source (save) or decoded (restore) bytes are at most this many times its workspace
#: share: the gathered sources and decoded temporaries live outside the workspace, and stay bounded.
BATCH_EXPANSION = 4


def _source_bytes(item: tuple[ChunkBlocks, _Seg, bytes]) -> int:
    """Source bytes of a save's ``(chunk, seg, key)`` segment."""
    return len(item[0].blocks) * item[1].block_bytes


def _coded_bound(seg: _Seg, n: int) -> int:
    """Workspace bytes the GPU engine's encode of ``n`` source bytes of ``seg`` takes: its payload slot,
    as :meth:`orbitkv_fs.gpu.engine.GpuCodecEngine._classify` sizes it (ANS and raw: the source size)."""
    codec = seg.codec_name
    d = seg.block_shape[-1] if seg.block_shape else 0
    if codec == "fp8" and seg.dtype.itemsize == 2:
        return n // 2
    if (codec.startswith("turboquant") and seg.dtype.itemsize == 2 and seg.role in (Role.KEY, Role.VALUE)
            and d in TURBOQUANT_HEAD_DIMS):
        return turboquant_stored_bytes(n, d, int(codec[-1]), seg.role)
    return n


def _decode_bound(h: SegmentHeader) -> int:
    """The bytes a restore batch counts for a segment with header ``h``: its payload (the workspace it is
    staged in); for ANS its decoded size, as before: the engine's workspace also holds nvCOMP's output, and
    the engine splits such a batch into flights itself (batches sized by payload plus output restored
    ANS 4 MiB segments 9-26% slower, docs/results/2026-11-30-pipeline-gpu-6)."""
    return h.original_length if h.format == Format.ANS else h.stored_length


def _pipelined(items: Iterable, start: Callable, end: Callable) -> list:
    """``end(start(item))`` for each item, in order, two at a time: item i+1 is started before item i is
    ended, so that one item's host work overlaps the other's device work. On an error every started item
    is still ended (an error there is dropped: the first one is raised). Answers the ``end`` results."""
    out: list = []
    pending = None
    try:
        for item in items:
            # The new item is pending before the previous one ends: should that end fail, it is ended too.
            done, pending = pending, start(item)
            if done is not None:
                out.append(end(done))
        if pending is not None:
            done, pending = pending, None
            out.append(end(done))
    except BaseException:
        if pending is not None:
            try:
                end(pending)
            except Exception:
                pass
        raise
    return out


def _gather_batch(items: list[tuple[_Seg, list[int]]], buffer, gather_blocks) -> tuple[list, object]:
    """Each item's blocks as one contiguous device region (a cupy array or a ``DeviceSpan``), in order,
    and the buffer holding the spans (None when there are none). Consecutive blocks of a contiguous layout
    are used where they lie; the others land in one ``buffer(nbytes)``, all moved by
    ``gather_blocks(table)`` (the GPU engine's block-copy kernel: one launch per batch)."""
    out: list = [None] * len(items)
    pending: list[tuple[int, int]] = []  # (item, offset in the buffer)
    size = 0
    for i, (seg, blocks) in enumerate(items):
        run = _device_run(seg, blocks)
        if run is not None:  # the pages themselves are the sources: no gather at all
            out[i] = run
        elif seg.copy is None:
            out[i] = seg.gather(blocks)
        else:
            pending.append((i, size))
            size = -(-(size + len(blocks) * seg.block_bytes) // _SLICE_ALIGN) * _SLICE_ALIGN
    if not pending:
        return out, None
    from .gpu.engine import DeviceSpan

    buf = buffer(size)
    addr = int(buf.data.ptr)
    for i, pos in pending:
        seg, blocks = items[i]
        out[i] = DeviceSpan(addr + pos, len(blocks) * seg.block_bytes, (len(blocks),) + seg.block_shape)
    gather_blocks(_block_table([(items[i][0], items[i][1], addr + pos) for i, pos in pending], gather=True))
    return out, buf


def _block_table(items: list[tuple[_Seg, Sequence[int], int]], *, gather: bool) -> np.ndarray:
    """Block-copy rows (``BLOCK_COPY_DTYPE``) between each item's page blocks and a contiguous device
    buffer at the item's address: pages to buffer when ``gather``, else buffer to pages (no row for a
    :data:`SKIP_BLOCK` position, whose part of the buffer stays where it is). Built for the whole batch at
    once (a numpy pass per field, not per item)."""
    counts = np.fromiter((len(b) for _, b, _ in items), dtype=np.int64, count=len(items))
    total = int(counts.sum())
    table = np.empty(total, dtype=BLOCK_COPY_DTYPE)
    if not total:
        return table
    # All (layer, role) segments of a chunk share its block list: each list is converted once.
    arrays: dict[int, np.ndarray] = {}
    for _, b, _ in items:
        if id(b) not in arrays:
            arrays[id(b)] = np.array(b, dtype=np.int64)
    ids = np.concatenate([arrays[id(b)] for _, b, _ in items])
    keep = None if gather or ids.min() >= 0 else ids != SKIP_BLOCK
    ids = ids.astype(np.uint64)
    # per item: block 0, block stride, rows, row bytes, row stride (seg.copy), block bytes, buffer address
    geo = np.repeat(np.array([seg.copy + (seg.block_bytes, addr) for seg, _, addr in items], dtype=np.uint64),
                    counts, axis=0)
    within = np.arange(total, dtype=np.uint64) - np.repeat((np.cumsum(counts) - counts).astype(np.uint64), counts)
    pages = geo[:, 0] + ids * geo[:, 1]
    flat = geo[:, 6] + within * geo[:, 5]
    table["src"], table["dst"] = (pages, flat) if gather else (flat, pages)
    table["src_stride"], table["dst_stride"] = (geo[:, 4], geo[:, 3]) if gather else (geo[:, 3], geo[:, 4])
    table["rows"], table["row_bytes"] = geo[:, 2], geo[:, 3]
    return table if keep is None else table[keep]


def _rows_of(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int, int] | None:
    """A block of ``shape`` / ``strides`` (bytes) as (rows, row bytes, row stride): its innermost
    contiguous run of dimensions is a row, the outer dimensions must step by one regular stride.
    None when they do not (the block then moves with cupy instead)."""
    row, d = itemsize, len(shape)
    while d and (shape[d - 1] == 1 or strides[d - 1] == row):
        row *= shape[d - 1]
        d -= 1
    rows, step = 1, row
    for k in range(d - 1, -1, -1):
        if shape[k] == 1:
            continue
        if rows == 1:
            step = strides[k]
        elif strides[k] != step * rows:
            return None
        rows *= shape[k]
    if step <= 0:
        return None
    return rows, row, step


def _gaps(regions: list[tuple[int, int]], used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``regions`` not covered by ``used`` (both lists of (offset, length), unit-aligned)."""
    out = []
    taken = sorted(used)
    for off, n in regions:
        pos, end = off, off + n
        for u, m in taken:
            if u + m <= pos or u >= end:
                continue
            if u > pos:
                out.append((pos, u - pos))
            pos = max(pos, u + m)
        if pos < end:
            out.append((pos, end - pos))
    return out


def _device_run(seg: _Seg, blocks: Sequence[int]):
    """The GPU pages of ``blocks`` as one C-contiguous device array, when they are consecutive blocks of a
    layout whose blocks are contiguous in memory (``separate``, ``sglang_token_pool``); else None."""
    if seg.base is None or isinstance(seg.base, np.ndarray):
        return None
    run = _run_of(blocks)
    if run is None:
        return None
    view = seg.base[run]
    return view if view.flags.c_contiguous else None


def _run_of(blocks: Sequence[int]) -> slice | None:
    """``blocks`` as a slice when they are consecutive ascending ids (engines often allocate a chunk's
    blocks together), else None (also when one is :data:`SKIP_BLOCK`)."""
    first, n = blocks[0], len(blocks)
    if first >= 0 and blocks[-1] - first == n - 1 and (n < 3 or all(b == first + j for j, b in enumerate(blocks))):
        return slice(first, first + n)
    return None


def _array_module(a):
    """numpy for host arrays, cupy for device ones (cupy imported only when a device array is here)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def _layer_codec(reg: EngineRegistration, desc: TensorDesc, codec_name: str) -> tuple[Codec | None, RawReason]:
    """The codec of ``desc``'s segments (None: stored raw) and the raw reason when policy forces raw."""
    if codec_name == "none":
        return None, RawReason.NONE
    kind = layer_attention(reg, desc)
    lossy = codec_name in LOSSY_CODECS
    if lossy and kind == AttentionKind.RECURRENT:
        return None, RawReason.POLICY
    if codec_name.startswith("turboquant"):
        stage_edge = desc.layer < reg.layer_start + 2 or desc.layer >= reg.layer_end - 2
        if kind == AttentionKind.MLA or not reg.head_layout_verified or stage_edge:
            return None, RawReason.POLICY
        return get_codec(codec_name, seed=reg.rotation_seed), RawReason.NONE
    return get_codec(codec_name), RawReason.NONE


def _gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


def _to_host(src, dst: np.ndarray) -> None:
    """Copy an engine block view (numpy, or cupy on a GPU) into the host array ``dst``."""
    if isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        import cupy

        cupy.ascontiguousarray(src).get(out=dst.view(src.dtype))


def _close_imports(imports: list) -> None:
    for obj in reversed(imports):
        obj.close()
    imports.clear()
