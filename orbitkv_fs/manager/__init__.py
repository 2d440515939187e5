"""The Cache Manager: engines, namespaces, the DRAM arena, the save/restore pipeline and the tier seams.

This package re-exports the public names; :class:`Manager` (in :mod:`.facade`) is a thin facade over parts
with one job each, one module per part, each opening with the primitives and state it owns:
:mod:`.registry` (engines, memory claims, process watch), :mod:`.leases` (lease table, expiry),
:mod:`.lookup`, :mod:`.save` (the save pipeline), :mod:`.restore` (the restore pipeline), :mod:`.lower`
(promotion, readahead, prefetch, invalidation, flush toward the lower tier), :mod:`.arena` (peers and
transfers), :mod:`.batching` (codec batches), :mod:`.stats` (counters, :class:`ManagerStats`),
:mod:`.device` (the GPU codec engine adapter), :mod:`.verify` (segment checks) and :mod:`.api` (the public
types).

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
  expires: the housekeeping thread drops it, so its extents can be evicted again (``leases_expired``). An
  engine holds at most ``max_leases_per_engine`` leases and ``max_leased_chunks_per_engine`` chunks under them;
  a lease past either ends its oldest first in the same way (``leases_displaced``). All pins together keep at
  most ``max_pinned_share`` of the pool from eviction (past it, evictions take pinned chunks:
  ``pinned_evictions``).
* admin: :meth:`~Manager.invalidate`, :meth:`~Manager.stats` (:class:`ManagerStats`, what metrics are built
  from), :meth:`~Manager.flush_dram`, :meth:`~Manager.list_objects`, :meth:`~Manager.config`.

Seams for the other parts:

* **Lower tier** (:class:`LowerTier`, implemented by ``orbitkv_fs.tiers.ssd.SsdTier``). Pass it as
  ``Manager(config, lower_tier=...)``; ``None`` means DRAM only. On :meth:`~Manager.flush_dram` the Manager
  calls ``submit(key, segment_bytes)`` with an immutable ``bytes`` the tier may keep; when DRAM evicts, it
  hands each eviction's victims to ``submit_many(keys, segments)`` as views of their extents, valid during
  the call only (a tier without ``submit_many`` gets ``submit`` of a ``bytes`` copy of each). Neither may
  block on I/O (asynchronous writeback); ``submit`` returns False, and ``submit_many`` does not count, what
  the tier drops (lane full, disabled). On a DRAM miss the Manager calls ``read(key)`` (``bytes`` of a
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
  scatters it, each batch one engine flight of at most half the codec budget so that two share the engine's
  workspace (two flights for `none` and `ans` registrations: ``batching.BATCH_FLIGHTS``).

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

from ..geometry import CudaIpcHandle, EngineRegistration, GeometryError, HostPagesHandle, TensorDesc
from ..histogram import DURATION_BUCKETS_S, DurationHistogram
from .api import (
    ArenaInfo,
    ChunkBlocks,
    EngineBusy,
    EngineInfo,
    FlushResult,
    InvalidateResult,
    LeaseError,
    LookupResult,
    LowerTier,
    ManagerConfig,
    ManagerStats,
    Miss,
    ObjectExtent,
    ObjectInfo,
    ObjectPage,
    PeerFetcher,
    PoolExhausted,
    RequestError,
    RestoreResult,
    SKIP_BLOCK,
    SaveResult,
    TierCounts,
    TooManyEngines,
    PagesLost,
    UnknownEngine,
)
from .facade import Manager

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
    "Miss",
    "ObjectExtent",
    "ObjectInfo",
    "ObjectPage",
    "PeerFetcher",
    "PoolExhausted",
    "RequestError",
    "RestoreResult",
    "SKIP_BLOCK",
    "SaveResult",
    "TensorDesc",
    "TierCounts",
    "TooManyEngines",
    "PagesLost",
    "UnknownEngine",
]
