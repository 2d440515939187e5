"""The Cache Manager: engines, namespaces, the DRAM arena, the save/restore pipeline and the tier seams.

The Manager owns codec selection, workspace, checksums and transfer lifetimes. Connectors only register
geometry and forward lookup/save/restore; the Manager reads and writes the engine's pages itself (host pages
in a shared-memory file, or GPU tensors imported through CUDA IPC).

Public API (in-process; :mod:`orbitkv_fs.client` exposes the same calls embedded or over the data plane,
the HTTP plane in :mod:`orbitkv_fs.server` calls the same methods):

* engines: :meth:`Manager.register_engine`, :meth:`~Manager.list_engines`, :meth:`~Manager.get_engine`,
  :meth:`~Manager.unregister_engine` (waits for the engine's outstanding work).
* data path: :meth:`~Manager.lookup` (leading run of present chunks, under a lease),
  :meth:`~Manager.save`, :meth:`~Manager.restore`, :meth:`~Manager.release`.
* admin: :meth:`~Manager.invalidate`, :meth:`~Manager.stats` (:class:`ManagerStats`, what metrics are built
  from), :meth:`~Manager.flush_dram`, :meth:`~Manager.list_objects`, :meth:`~Manager.config`.

Seams for the other parts:

* **Lower tier** (:class:`LowerTier`, implemented by ``orbitkv_fs.tiers.ssd.SsdTier``). Pass it as
  ``Manager(config, lower_tier=...)``; ``None`` means DRAM only. When DRAM evicts an object (or on
  :meth:`~Manager.flush_dram`) the Manager calls ``submit(key, segment_bytes)`` with an immutable ``bytes``
  the tier may keep; ``submit`` must not block on I/O (asynchronous writeback) and returns False when it
  drops the object (lane full, disabled). On a DRAM miss the Manager calls ``read(key)`` (``bytes`` of a
  CRC-valid segment or ``None``; corrupt -> ``None``), verifies it again and readmits it to DRAM.
  ``contains``, ``invalidate``, ``flush``, ``stats``, ``iter_objects`` and ``close`` serve lookup, admin and
  shutdown. The Manager closes the tier in :meth:`~Manager.close`.
* **Peers** (:class:`PeerFetcher`): ``Manager(..., peer_fetcher=...)`` or :meth:`~Manager.set_peer_fetcher`.
  On a miss in DRAM and the lower tier, the Manager calls ``fetch(keys) -> {key: segment bytes}``; every
  answer is verified like any segment (header, the key's namespace/layer/role, CRC32C) and a bad one is a
  miss. ``lookup_prefix(namespace, chunks, layers)`` lets lookups count chunks peers hold. For serving peers:
  :meth:`~Manager.lease_objects` leases extents by key, :meth:`~Manager.read_object` returns a segment's
  bytes from any local tier, :meth:`~Manager.arena_info` gives the arena's file path, size and base address
  (for the Transfer Engine to register), and :meth:`~Manager.reserve` / :meth:`~Manager.publish` /
  :meth:`~Manager.abort` let a transfer write verified segment bytes straight into the arena.
* **GPU codec engine**: with a GPU (and ``orbitkv_fs.gpu`` importable), encode/decode batches go through a
  small adapter over its batch API; without one the host codecs (:mod:`orbitkv_fs.codecs`) run.

Invariants:

1. No segment is served without a valid header and CRC32C; a bad segment is a miss for its key, reported in
   :class:`RestoreResult`, never an exception that stops the Manager.
2. Nothing is published before its bytes are in place; an extent under a lease is never freed, evicted or
   overwritten; invalidated or evicted leased objects are hidden at once and reclaimed when leases drain.
3. A restore validates every destination before writing anything.
4. Every reservation (arena bytes, leases, workspace) returns to zero when requests complete or fail:
   :class:`ManagerStats` ``reserved_bytes``, ``leases_active``, ``workspace_bytes``, ``inflight_requests``.
5. Bytes are never served across storage namespaces (:func:`orbitkv_fs.namespace.namespace_v2`).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence, runtime_checkable

import msgspec

from .errors import OrbitKVError
from .geometry import CudaIpcHandle, EngineRegistration, GeometryError, HostPagesHandle, TensorDesc
from .keys import ObjectKey

__all__ = [
    "ArenaInfo",
    "ChunkBlocks",
    "CudaIpcHandle",
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


# ---------------------------------------------------------------------------------------------- config


class ManagerConfig(msgspec.Struct, frozen=True):
    """Manager settings; :mod:`orbitkv_fs.server.cli` builds it from the command line."""

    pool_size: int = 1 << 30
    #: Default codec of engines that do not ask for one: none|ans|fp8|turboquant-4|turboquant-3.
    storage_codec: str = "none"
    #: Fraction of the pool the codec path may use as workspace for a batch (bounds batch size).
    storage_codec_budget: float = 0.05
    eviction: str = "lru"  # lru | s3fifo
    #: Directory of the arena file (a tmpfs: /dev/shm where it exists).
    shm_dir: str = "/dev/shm"
    #: "auto": pin with cudaHostRegister and use the GPU codec engine when a GPU is present; "cpu": never.
    device: str = "auto"
    #: Segments encoded per codec batch.
    batch_segments: int = 64
    host: str = "127.0.0.1"


# ---------------------------------------------------------------------------------------------- requests / results


class ChunkBlocks(msgspec.Struct, frozen=True, array_like=True):
    """One chunk of a save/restore: its 16-byte chunk key (:func:`orbitkv_fs.keys.chunk_key`) and the
    engine block ids (in token order) that hold it."""

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


# ---------------------------------------------------------------------------------------------- seams


@runtime_checkable
class LowerTier(Protocol):
    """A tier below DRAM (the SSD log). See the module docstring for the contract."""

    name: str

    def submit(self, key: ObjectKey, segment: bytes) -> bool:
        """Queue ``segment`` (header + payload, CRC-valid) for asynchronous writeback. Never blocks on
        I/O; False when dropped. A later submit of the same key replaces the earlier one."""

    def read(self, key: ObjectKey) -> bytes | None:
        """The segment bytes of ``key`` after CRC validation, or None (absent, or corrupt: then that
        record is invalidated)."""

    def contains(self, key: ObjectKey) -> bool:
        """True when ``key`` is readable (published)."""

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, namespace: bytes | None = None,
                   all: bool = False) -> TierCounts:
        """Hide the matching objects from readers at once; answer how many and their stored bytes."""

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


class Manager:
    """One per host (remote mode) or per engine process (embedded mode). Thread-safe."""

    def __init__(self, config: ManagerConfig | None = None, *, lower_tier: LowerTier | None = None,
                 peer_fetcher: PeerFetcher | None = None) -> None:
        """Create the arena file, pin it when a GPU is present, start with no engines."""
        raise NotImplementedError

    # -- engines ------------------------------------------------------------------------------------

    def register_engine(self, reg: EngineRegistration) -> EngineInfo:
        """Validate ``reg`` against the tensors its handles import, then register it. Raises
        :class:`GeometryError` (naming the field) and registers nothing on any mismatch."""
        raise NotImplementedError

    def list_engines(self) -> list[EngineInfo]:
        raise NotImplementedError

    def get_engine(self, engine_id: str) -> EngineInfo:
        """Raises :class:`UnknownEngine`."""
        raise NotImplementedError

    def unregister_engine(self, engine_id: str, *, timeout: float | None = 60.0) -> None:
        """Refuse new requests for the engine, wait for its outstanding ones, release its leases, codec
        resources and imported tensors. Cached objects stay (they belong to the namespace)."""
        raise NotImplementedError

    # -- data path ----------------------------------------------------------------------------------

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        """Length of the leading run of ``chunks`` present in full. Lower-tier objects of that run are
        promoted to DRAM; with ``lease`` the run's extents stay leased until :meth:`restore` (given the
        lease id) or :meth:`release`."""
        raise NotImplementedError

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks]) -> SaveResult:
        """Gather each chunk's blocks per (layer, role) into segments, encode them in batches, admit them
        to DRAM (evicting, and demoting to the lower tier, as needed). Chunks already present are skipped.
        Raises :class:`RequestError` before doing anything when a block id or key is bad."""
        raise NotImplementedError

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0) -> RestoreResult:
        """Write the chunks' cached KV into the given blocks. Every destination is validated first
        (:class:`RequestError`, nothing written); a missing or corrupt segment is a miss for its chunk.
        ``lease_id`` (from :meth:`lookup`) is released when the restore ends."""
        raise NotImplementedError

    def release(self, lease_id: int) -> None:
        """Drop a lease from :meth:`lookup` or :meth:`lease_objects`. Raises :class:`LeaseError`."""
        raise NotImplementedError

    # -- admin --------------------------------------------------------------------------------------

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False) -> InvalidateResult:
        """Drop objects from every tier: exact ``keys``; ``chunks`` of ``engine_id`` or ``namespace``;
        everything of a namespace or an engine's namespace; or ``all``. Leased objects are hidden at once
        and freed when their leases drain. Answers per-tier object counts and stored bytes."""
        raise NotImplementedError

    def stats(self) -> ManagerStats:
        raise NotImplementedError

    def flush_dram(self) -> FlushResult:
        """Demote every unleased DRAM object to the lower tier and wait for its writeback; DRAM keeps
        nothing it could hand over (without a lower tier the objects are simply dropped)."""
        raise NotImplementedError

    def list_objects(self, namespace: bytes | None = None, prefix: str = "", limit: int = 1000,
                     cursor: str | None = None) -> ObjectPage:
        """Page through cached objects (DRAM then the lower tier), ``prefix`` a hex prefix of the chunk."""
        raise NotImplementedError

    def config(self) -> ManagerConfig:
        raise NotImplementedError

    # -- peers --------------------------------------------------------------------------------------

    def set_peer_fetcher(self, fetcher: PeerFetcher | None) -> None:
        raise NotImplementedError

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[ObjectExtent | None]]:
        """Lease the DRAM extents of ``keys`` (None where not in DRAM); release with :meth:`release`."""
        raise NotImplementedError

    def read_object(self, key: ObjectKey) -> bytes | None:
        """A verified copy of ``key``'s segment from DRAM or the lower tier (no peers, no promotion)."""
        raise NotImplementedError

    def arena_info(self) -> ArenaInfo:
        raise NotImplementedError

    def reserve(self, nbytes: int) -> ObjectExtent:
        """Reserve an arena extent (evicting if needed) for bytes a transfer writes in place; its
        ``generation`` is the reservation id. Counts in ``reserved_bytes`` until published or aborted."""
        raise NotImplementedError

    def publish(self, reservation: ObjectExtent, key: ObjectKey) -> bool:
        """Verify the segment written into ``reservation`` (header, key's layer/role, CRC) and publish it
        under ``key``; on failure the extent is freed and False returned."""
        raise NotImplementedError

    def abort(self, reservation: ObjectExtent) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Unregister every engine, close the lower tier, unmap and unlink the arena."""
        raise NotImplementedError
