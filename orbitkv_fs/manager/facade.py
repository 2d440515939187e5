"""The :class:`Manager`: one object that engines, the data plane, the HTTP app and peers call.

It holds the shared state (config, the DRAM tier, the lower tier, the locks) and is composed of parts
with one job each, one module per part: :mod:`.registry` (engines), :mod:`.leases`, :mod:`.lookup`,
:mod:`.save`, :mod:`.restore`, :mod:`.hostpath` (their batches of exact host segments), :mod:`.lower` (the tier below DRAM), :mod:`.arena` (peers and transfers),
:mod:`.batching`, :mod:`.stats`. Here only construction and shutdown.

Invariants: :meth:`Manager.close` unregisters every engine, drops every lease, closes the lower tier and
unmaps and unlinks the arena, once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time

from ..access import HandleClaims
from ..codecs import CODEC_NAMES, get_codec
from ..errors import CodecError, CodecUnavailable
from ..histogram import DurationCounter
from ..tiers.dram import DramTier
from .api import LowerTier, ManagerConfig, PeerFetcher, UnknownEngine
from .arena import ArenaAccess
from .batching import Batching
from .device import _GpuCodecs, _gpu_present
from .hostpath import HostPath
from .leases import Leases, _Lease
from .lookup import Lookup
from .lower import LowerTierCoordination, demoter
from .registry import RECLAIM_INTERVAL_S, Registry, _Engine
from .restore import RestorePipeline
from .save import SavePipeline
from .stats import Counters, _COUNTERS, _DURATIONS

log = logging.getLogger("orbitkv_fs.manager")


class Manager(Registry, Leases, Lookup, SavePipeline, RestorePipeline, HostPath, LowerTierCoordination,
              ArenaAccess, Batching, Counters):
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
        if config.batch_segments < 1:
            raise ValueError("batch_segments must be >= 1")
        if config.max_engines_per_user < 1 or config.max_tensors_per_user < 1:
            raise ValueError("max_engines_per_user and max_tensors_per_user must be >= 1")
        if config.max_leases_per_engine < 1 or config.max_leased_chunks_per_engine < 1:
            raise ValueError("max_leases_per_engine and max_leased_chunks_per_engine must be >= 1")
        if not 0.0 <= config.max_pinned_share <= 1.0:
            raise ValueError(f"max_pinned_share must be within [0, 1], not {config.max_pinned_share}")
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
                             demote=None if lower_tier is None else demoter(lower_tier), reserve=config.reserve_pool,
                             pin_share=config.max_pinned_share)
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
        self._cpu_stages: dict[str, list] = {}  # stage -> [host CPU seconds, segments]
        self._inflight = 0
        self._closed = False
        self._private_warned = False  # the pool's directory filled up under it (Counters.stats says so once)
        # Prefix memory for prefetch: namespace + chunk -> the chunks that followed it in a save or
        # lookup (up to ssd_prefetch_chunks of them), least recently recorded first.
        self._succ: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()
        self._succ_lock = threading.Lock()
        self._inval_epoch = 0  # bumped by invalidate(): a prefetch that raced one is not kept
        # the housekeeping thread (dead engines, expired leases): started with the first watched engine
        # or the first lease that can expire
        self._housekeeper: threading.Thread | None = None
        self._housekeeper_stop = threading.Event()
        # recently expired or displaced lease ids -> engine id: a late restore naming one still runs, without
        # the lease
        self._expired: collections.OrderedDict[int, str | None] = collections.OrderedDict()
        self._reclaim_pages()  # those of engines killed while no Manager was there to reap them
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL_S

    def config(self) -> ManagerConfig:
        return self._config

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
