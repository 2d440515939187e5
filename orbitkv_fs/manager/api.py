"""The Manager's public types: its errors, :class:`ManagerConfig`, the request and result structs of the
engine calls, :class:`ManagerStats`, and the two seams other parts implement (:class:`LowerTier`,
:class:`PeerFetcher`).

Primitives: the error classes (each a typed :class:`~orbitkv_fs.errors.OrbitKVError` the HTTP and data
planes map to a status), the msgspec structs (frozen: what crosses the data plane and the REST API), the
:data:`SKIP_BLOCK` marker of a restore.

Invariants: nothing here holds state or imports another part of the Manager; the structs are the wire
format of :mod:`orbitkv_fs.dataplane` and :mod:`orbitkv_fs.server`, so a field is only ever added with a
default.
"""

from __future__ import annotations

import logging
from typing import Annotated, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import msgspec

from ..errors import OrbitKVError
from ..geometry import EngineRegistration
from ..histogram import DurationHistogram
from ..keys import ObjectKey

log = logging.getLogger("orbitkv_fs.manager")


class RequestError(OrbitKVError, ValueError):
    """A save/restore/lookup request is malformed (unknown block, wrong size, layer out of range, bad key).
    Nothing was written."""


class UnknownEngine(OrbitKVError, KeyError):
    """No engine with that id is registered (or it is being unregistered)."""


class EngineBusy(OrbitKVError):
    """The engine id is taken, or unregister timed out waiting for outstanding work."""


class TooManyEngines(OrbitKVError):
    """A registration over the registering OS user's quota (``max_engines_per_user``, ``max_tensors_per_user``):
    unregister one of its engines first."""


class PagesLost(OrbitKVError):
    """The engine's pages file shrank under the Manager's mapping (its owner truncated it): what the call read
    or wrote past the file's new end is lost, nothing the call read was published, and the engine's calls are
    refused until it is unregistered and registers again over whole pages."""


class LeaseError(OrbitKVError, KeyError):
    """Unknown or already released lease id."""


class PoolExhausted(OrbitKVError):
    """The DRAM pool cannot make room: what is left is leased or reserved."""


class ManagerConfig(msgspec.Struct, frozen=True):
    """Manager settings; :mod:`orbitkv_fs.server.cli` builds it from the command line."""

    pool_size: int = 1 << 30
    #: Default codec of engines that do not ask for one: none|ans|fp8|turboquant-4|turboquant-3.
    storage_codec: str = "none"
    #: Bytes of codec workspace per worker (``--storage-codec-budget``): bounds the GPU engine's retained
    #: workspace arena; an engine flight's encoded bytes take at most half of it, a codec batch's one flight's
    #: (``BATCH_FLIGHTS`` for `none` and `ans` registrations; its source bytes at most ``BATCH_EXPANSION``
    #: flights': a compressing codec's batch carries more source per batch).
    storage_codec_budget: int = 64 << 20
    eviction: str = "lru"  # lru | s3fifo
    #: Directory of the arena file (a tmpfs: /dev/shm where it exists).
    shm_dir: str = "/dev/shm"
    #: Allocate the arena's memory when the Manager starts (``--reserve-pool``, the server's default), not page
    #: by page as it fills (:class:`~orbitkv_fs.tiers.dram.Arena`).
    reserve_pool: bool = False
    #: "auto": pin with cudaHostRegister and use the GPU codec engine when a GPU is present; "cpu": never.
    device: str = "auto"
    #: Segments per codec batch, at most (``--batch-segments``; the GPU engine splits more than 1,024
    #: into its descriptor batches; the codec budget closes a batch earlier where segments are large). Each
    #: batch carries a fixed host cost (descriptor rows, launches, a wait, block tables), so a cap below what
    #: the workspace holds slows small segments; a save or restore overlaps one batch's host work with the
    #: previous one's GPU work, so fewer, larger batches leave more of it unoverlapped at a request's start
    #: and end. At 512 KiB against 256: fp8 and turboquant-4 save 1.1-1.3x faster, turboquant-4 restores
    #: 1.2x faster; 1024 was no better than 512 on a 2,304-segment request (docs/results/2026-12-02-batch-1024).
    batch_segments: int = 512
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
    #: Leases one engine may hold at once, and chunks pinned under them (a lookup's lease pins the run it
    #: found). A lease past either bound displaces the engine's oldest leases, which end as if expired (a
    #: restore under one still runs, on a hold of its own); a lookup whose run alone is over the chunk bound
    #: is answered without a lease. Each pinned chunk costs the Manager about 150 bytes.
    max_leases_per_engine: int = 1024
    max_leased_chunks_per_engine: int = 65536
    #: Share of the pool that lookup leases' pins keep from eviction, all engines together: past it an
    #: eviction takes pinned chunks too, oldest first, of the namespaces whose pins hold more than an equal part
    #: of the share (their restores miss). Without it one process's pins could hold the whole pool, and every
    #: other engine's saves would find no room; without the equal parts its pins would make others' miss.
    max_pinned_share: float = 0.5
    #: Engines, and tensors across them, that one OS user may have registered at once (registrations from
    #: another process: the data plane, the HTTP plane). Each registered tensor costs the Manager about 1.6 KB
    #: (an 8,192-tensor registration 12.8 MiB). In-process registrations (embedded mode) are not counted.
    max_engines_per_user: int = 256
    max_tensors_per_user: int = 16384


#: A restore destination that is not written: that block's part of the chunk is read and dropped. An engine
#: whose own prefix cache already holds the chunk's first blocks (or that needs only its first blocks) loads
#: the rest of a multi-block chunk without touching the blocks it shares with other requests.
SKIP_BLOCK = -1


class ChunkBlocks(msgspec.Struct, frozen=True, array_like=True):
    """One chunk of a save/restore: its 16-byte chunk key (:func:`orbitkv_fs.keys.chunk_key`) and the
    engine block ids (in token order) that hold it. In a restore, :data:`SKIP_BLOCK` entries are positions
    of the chunk left unwritten (the segment still spans every position). The key's length and the blocks'
    presence are checked when a request is decoded (the data plane), and by the Manager."""

    key: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    blocks: Annotated[list[int], msgspec.Meta(min_length=1)]


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
    #: False: the flush's deadline passed before the lower tier took or wrote back everything (a disk that
    #: does not answer); what it did not take is counted in ``dropped``.
    complete: bool = True


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
    leases_active: int  # lookup and peer leases handed out and not ended
    leased_bytes: int  # bytes of segments leased one by one (restores in progress, peers); pins: pinned_chunks
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
    #: Seconds the host waited on each GPU worker's streams (per worker: save, restore).
    gpu_wait_seconds: dict[str, float] = {}
    #: Speculative SSD prefetch: segments (and their bytes) read ahead into DRAM, prefetched objects later
    #: served (hits), and prefetched objects that left DRAM without being served (wasted).
    prefetch_segments: int = 0
    prefetch_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    #: Engines the Manager unregistered because their process had exited.
    engines_reaped: int = 0
    #: Pages files (staging areas, CPU engines' KV) of processes killed before they could remove them, which
    #: the Manager removed from its shared-memory directory (at start, after it reaps an engine, and every
    #: ``RECLAIM_INTERVAL_S`` while its housekeeping runs).
    pages_files_reclaimed: int = 0
    registrations_refused: int = 0  # over an OS user's quota of engines or tensors
    #: Engines whose pages file shrank while the Manager had it mapped (their calls are refused since).
    pages_lost: int = 0
    #: Pool bytes its directory could not back when they were first written (``reserve_pool`` off and the
    #: tmpfs full): private memory of the Manager since, instead of the arena file's.
    pool_private_bytes: int = 0
    leases_expired: int = 0
    #: Leases ended early because their engine took more than ``max_leases_per_engine`` leases or
    #: ``max_leased_chunks_per_engine`` chunks under them (oldest first), and lookups answered without a lease
    #: because their run alone was over the chunk bound.
    leases_displaced: int = 0
    leases_refused: int = 0
    #: Chunks pinned by lookup leases now (each chunk once, however many leases pin it).
    pinned_chunks: int = 0
    #: Segments evicted although a lookup's lease pinned their chunk: the pins held more than
    #: ``max_pinned_share`` of the pool.
    pinned_evictions: int = 0
    #: The cuFile direct path (an SSD tier with ``--ssd-backend cufile`` under the GPU codec engine):
    #: segments saves wrote from device memory straight to the SSD, and segments restores read from the
    #: SSD into device memory and decoded there (the rest go through DRAM and io_uring writeback).
    ssd_direct_writes: int = 0
    ssd_direct_reads: int = 0
    #: Host CPU time of the pipelines' stages (the calling thread's ``time.thread_time``), and the segments
    #: each stage handled: seconds / segments is a stage's host cost per segment. Stages: ``save`` (the
    #: whole request), ``save_encode`` (gather, header and CRC32C, or a codec batch's gather and encode
    #: submit), ``save_publish`` (collect, copy-in and publish); ``restore`` (the whole request),
    #: ``restore_acquire`` (lease the sources), ``restore_verify`` (headers and CRC32C against their
    #: destinations), ``restore_write`` (decode and scatter into the engine's blocks).
    host_cpu_seconds: dict[str, float] = {}
    host_cpu_segments: dict[str, int] = {}


@runtime_checkable
class LowerTier(Protocol):
    """A tier below DRAM (the SSD log). See the module docstring for the contract."""

    name: str

    def submit(self, key: ObjectKey, segment: bytes, *, timeout: float = 0.0) -> bool:
        """Queue ``segment`` (header + payload, CRC-valid) for asynchronous writeback. Never blocks on
        I/O; False when dropped. A later submit of the same key replaces the earlier one. With ``timeout``
        it may wait that long for room in the lane (bulk demotion, e.g. :meth:`Manager.flush_dram`).
        A tier may also have ``submit_many(keys, segments) -> int`` (the SSD tier does): ``submit`` of each,
        the segments views valid during the call only, answering how many it took; DRAM's eviction then
        hands it each batch of victims (otherwise it submits a copy of each)."""

    def read(self, key: ObjectKey) -> bytes | None:
        """The segment bytes of ``key`` after CRC validation, or None (absent, or corrupt: then that
        record is invalidated)."""

    def read_many(self, keys: Sequence[ObjectKey],
                  sink: Callable[[int, "bytes | memoryview"], None] | None = None) -> list[bytes | None]:
        """:meth:`read` of several keys with their I/O in flight together (a restore's misses). With
        ``sink``, each valid segment goes to ``sink(index, segment)`` as it lands instead of into the
        list (a view valid during the call only: lookups admit it to DRAM while later reads are in flight)."""

    def contains(self, key: ObjectKey) -> bool:
        """True when ``key`` is readable (published). A tier may also have ``contains_many(keys) -> [bool]``
        (the SSD tier does): a lookup then asks for a chunk's segments in one call."""

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, namespace: bytes | None = None,
                   chunks: Sequence[bytes] | None = None, all: bool = False) -> TierCounts:
        """Hide the matching objects (``keys``; the ``chunks`` of ``namespace``, held or not; all of
        ``namespace``; ``all``) from readers at once, and answer (how many, their stored bytes) only once
        the invalidation is durable: a restart never brings them back."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted object is published (or dropped); ``TimeoutError`` past ``timeout``
        seconds."""

    def stats(self) -> Mapping[str, float]:
        """The tier's counters and gauges (flat, Prometheus-style names without the orbitkv_ prefix)."""

    def iter_objects(self, namespace: bytes | None = None) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, stored_bytes)`` of the published objects, optionally of one namespace. A tier may also have
        ``listing(match_chunk, after=b"", limit=None) -> [(packed key, stored bytes)]`` (the SSD tier does): a
        page of the admin listing, sorted by key, of the chunks whose 32-byte prefix ``match_chunk``es, after
        ``after``, the first ``limit`` at least; without it, the listing sorts all of these per page."""

    def close(self) -> None:
        """Flush and release everything."""


@runtime_checkable
class PeerFetcher(Protocol):
    """Other Managers, asked after DRAM and the lower tier miss."""

    def fetch(self, keys: Sequence[ObjectKey]) -> Mapping[ObjectKey, bytes]:
        """Segment bytes for whichever of ``keys`` peers hold (unverified: the Manager verifies them)."""

    def lookup_prefix(self, namespace: bytes, chunks: Sequence[bytes], layers: Sequence[tuple[int, int]]) -> int:
        """How many leading ``chunks`` a peer holds in full (every ``(layer, role)`` of ``layers``)."""
