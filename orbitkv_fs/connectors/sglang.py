"""SGLang adapter: :class:`OrbitKVHiCacheStorage`, a HiCache L3 storage backend over an OrbitKV-FS Manager.

Start SGLang with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "orbitkv",
            "module_path": "orbitkv_fs.connectors.sglang", "class_name": "OrbitKVHiCacheStorage",
            "interface_v1": 1, "orbitkv.manager": "tcp://127.0.0.1:9092"}'

SGLang's ``StorageBackendFactory`` builds the backend as ``OrbitKVHiCacheStorage(storage_config, kwargs)``
and then calls :meth:`~OrbitKVHiCacheStorage.register_mem_pool_host`. SGLang hands out page hashes
(strings, already chained over the prefix) and host-pool indices; each page becomes one chunk key
(:func:`~orbitkv_fs.connectors.common.engine_hash_keys`, salted with the model, TP/PP rank), stored per
layer as K and V segments. SGLang's host pool is pinned memory of the SGLang process, which the Manager
cannot import, so pages go through a registered staging file
(:class:`~orbitkv_fs.connectors.common.StagingPages`): one host copy each way. Supported host pools:
MHA token pools (``MHATokenToKVPoolHost``) in the ``layer_first``, ``page_first``, ``page_first_direct``
and ``page_head`` layouts; other pools (MLA, hybrid, sparse) leave the backend disabled (every call a
miss) rather than guess a head layout.

Both interfaces are served: ``interface_v1`` (``batch_get_v1``/``batch_set_v1`` with host indices, the
zero-copy path SGLang selects with ``"interface_v1": 1``) and the generic ``get``/``set``/``batch_get``/
``batch_set`` with flat data pages.

Invariants: importing this module never imports sglang or torch when they are absent; a failed or
unreachable Manager makes a page a miss (``False``/``None``), never an exception into SGLang's threads;
a backend that could not register at start (Manager not up yet) registers on a later call, and a Manager
that restarted gets the staging file registered again on the next call;
``batch_get_v1`` reports success only for the leading run of restored pages; saves and loads each use
their own half of the staging file, so SGLang's backup and prefetch threads never share a slot.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, List, Optional

from .common import (
    EngineSession,
    ManagerGuard,
    StagingPages,
    connect_client,
    engine_hash_keys,
    ping_probe,
    register_session,
)

try:  # SGLang is optional: without it the class still imports (and is checked against the wheel's source).
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
except ImportError:  # pragma: no cover - exercised where SGLang is absent
    HiCacheStorage = object  # type: ignore[assignment,misc]
    HiCacheStorageConfig = Any  # type: ignore[assignment,misc]
    HiCacheStorageExtraInfo = Any  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

EXTRA_PREFIX = "orbitkv."
_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def page_view(pool: Any, index: int) -> "torch.Tensor":
    """View ``[2, layers, page_size, heads, head_dim]`` of the host-pool page starting at token ``index``."""
    buf, t = pool.kv_buffer, pool.page_size
    if pool.layout == "layer_first":  # [2, L, size, H, D]
        return buf[:, :, index : index + t]
    if pool.layout == "page_first":  # [2, size, L, H, D]
        return buf[:, index : index + t].permute(0, 2, 1, 3, 4)
    if pool.layout == "page_first_direct":  # [2, pages, L, T, H, D]
        return buf[:, index // t]
    if pool.layout == "page_head":  # [2, pages, H, T, L, D]
        return buf[:, index // t].permute(0, 3, 2, 1, 4)
    raise ValueError(f"unsupported host pool layout {pool.layout!r}")


def flat_page_view(pool: Any, flat: "torch.Tensor") -> "torch.Tensor":
    """View ``[2, layers, page_size, heads, head_dim]`` of a flat data page (``get_data_page(flat=True)``)."""
    L, T, H, D = pool.layer_num, pool.page_size, pool.head_num, pool.head_dim
    if pool.layout in ("layer_first", "page_first_direct"):
        return flat.view(2, L, T, H, D)
    if pool.layout == "page_first":
        return flat.view(2, T, L, H, D).permute(0, 2, 1, 3, 4)
    if pool.layout == "page_head":
        return flat.view(2, H, T, L, D).permute(0, 3, 2, 1, 4)
    raise ValueError(f"unsupported host pool layout {pool.layout!r}")


class OrbitKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    """SGLang HiCache storage backend backed by an OrbitKV-FS Manager (see the module docstring)."""

    def __init__(self, storage_config: "HiCacheStorageConfig", kwargs: Optional[dict] = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._config = storage_config
        self._address = extra.get(EXTRA_PREFIX + "manager", os.environ.get("ORBITKV_MANAGER", "tcp://127.0.0.1:9092"))
        self._codec = extra.get(EXTRA_PREFIX + "codec")
        self._http = extra.get(EXTRA_PREFIX + "http")
        self._slots = int(extra.get(EXTRA_PREFIX + "staging_pages", 32))
        self._guard = ManagerGuard(cooldown_s=float(extra.get(EXTRA_PREFIX + "cooldown_s", 5.0)),
                                   probe=ping_probe(self._address))
        self._timeout_s = float(extra.get(EXTRA_PREFIX + "timeout_s", 30.0))
        model = getattr(storage_config, "model_name", None) or "model"
        self._model = str(model)
        self._salt = (f"{model}|tp{storage_config.tp_rank}/{storage_config.tp_size}"
                      f"|pp{storage_config.pp_rank}/{storage_config.pp_size}").encode()
        self._client: Any = None
        self._session: EngineSession | None = None
        self._staging: StagingPages | None = None
        self._registration: Any = None
        self._set_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._get_lock = threading.Lock()
        self.mem_pool_host: Any = None

    # -- registration -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any):
        self.mem_pool_host = mem_pool_host
        pool = mem_pool_host
        if getattr(self._config, "is_mla_model", False) or getattr(pool, "layout", None) not in _LAYOUTS \
                or not all(hasattr(pool, a) for a in ("kv_buffer", "head_num", "head_dim", "layer_num")):
            log.warning("OrbitKV-FS: host pool %s (layout %s) is not supported; storage backend disabled",
                        type(pool).__name__, getattr(pool, "layout", None))
            return
        if self._staging is not None:
            return
        dtype = str(pool.dtype).removeprefix("torch.")
        self._staging = StagingPages(num_layers=int(pool.layer_num), slots=2 * self._slots,
                                     block_size=int(pool.page_size), num_heads=int(pool.head_num),
                                     head_dim=int(pool.head_dim), dtype=dtype)
        from .hf import _as_torch

        self._k = [_as_torch(self._staging.key(i), pool.dtype) for i in range(pool.layer_num)]
        self._v = [_as_torch(self._staging.value(i), pool.dtype) for i in range(pool.layer_num)]
        self._registration = self._staging.registration(
            model=self._model, engine_kind="sglang", codec=self._codec, tp_rank=self._config.tp_rank,
            tp_size=self._config.tp_size, pp_rank=self._config.pp_rank, pp_size=self._config.pp_size)
        if self._ensure_session() is None:
            log.warning("OrbitKV-FS: registering with the Manager at %s failed (%s); retrying on later calls",
                        self._address, self._guard.stats.last_error)

    def _ensure_session(self) -> EngineSession | None:
        """The registered session; registers first when that has not succeeded yet (a Manager started after
        SGLang, or down at start), at most once per guard cool-down."""
        if self._session is not None or self._registration is None:
            return self._session
        with self._register_lock:  # SGLang's backup and prefetch threads: one registration, not two
            if self._session is None:
                self._register()
        return self._session

    def _register(self) -> None:
        if self._client is None:
            self._client = self._guard.call(
                "connect", lambda: connect_client(self._address, timeout_s=self._timeout_s), None)
            if self._client is None:
                return
        client = self._client
        self._session, self._unregister = register_session(client, self._registration, self._http, self._guard,
                                                           timeout_s=self._timeout_s)

    # -- page copies --------------------------------------------------------------------------------

    def _stage_in(self, pages: list["torch.Tensor"], base: int) -> None:
        """Copy ``[2, L, T, H, D]`` page views into staging slots ``base..``."""
        import torch

        stacked = torch.stack(pages)  # [n, 2, L, T, H, D]
        n = len(pages)
        for layer in range(len(self._k)):  # staging slots are [H, T, D]
            self._k[layer][base : base + n] = stacked[:, 0, layer].transpose(1, 2)
            self._v[layer][base : base + n] = stacked[:, 1, layer].transpose(1, 2)

    def _stage_out(self, page: "torch.Tensor", slot: int) -> None:
        """Copy staging slot ``slot`` into one ``[2, L, T, H, D]`` page view."""
        for layer in range(len(self._k)):
            page[0, layer].copy_(self._k[layer][slot].transpose(0, 1))
            page[1, layer].copy_(self._v[layer][slot].transpose(0, 1))

    def _keys(self, keys: List[str]) -> list[bytes]:
        return engine_hash_keys(keys, salt=self._salt)

    def _save(self, keys: List[str], pages: list["torch.Tensor"]) -> List[bool]:
        if self._ensure_session() is None or not keys:
            return [False] * len(keys)
        out: list[bool] = []
        with self._set_lock:
            session = self._session
            if session is None:  # closed while this call waited for the lock
                return [False] * len(keys)
            for first in range(0, len(keys), self._slots):
                part = keys[first : first + self._slots]
                self._stage_in(pages[first : first + self._slots], 0)
                res = session.save(self._keys(part), [[s] for s in range(len(part))])
                # Dropped segments (no room in DRAM or the lower tier) belong to pages the result does not
                # name: none of this round's pages is reported stored, so SGLang does not count on them.
                out += [res is not None and res.dropped_segments == 0] * len(part)
        return out

    def _load(self, keys: List[str], pages: list["torch.Tensor"]) -> List[bool]:
        if self._ensure_session() is None or not keys:
            return [False] * len(keys)
        out: list[bool] = []
        base = self._slots  # loads use the second half of the staging file
        with self._get_lock:
            session = self._session
            if session is None:  # closed while this call waited for the lock
                return [False] * len(keys)
            for first in range(0, len(keys), self._slots):
                part = keys[first : first + self._slots]
                ckeys = self._keys(part)
                missed = set(session.restore(ckeys, [[base + s] for s in range(len(part))]))
                for s, k in enumerate(ckeys):
                    if k in missed:
                        return out + [False] * (len(keys) - len(out))
                    self._stage_out(pages[first + s], base + s)
                    out.append(True)
        return out

    # -- interface v1 (host indices) ----------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional["HiCacheStorageExtraInfo"] = None) -> int:
        if self._ensure_session() is None:
            return 0
        return self._session.lookup(self._keys(keys))

    def batch_get_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: Optional["HiCacheStorageExtraInfo"] = None) -> List[bool]:
        t = self.mem_pool_host.page_size if self.mem_pool_host is not None else 1
        pages = [page_view(self.mem_pool_host, int(host_indices[i * t])) for i in range(len(keys))] \
            if self._ensure_session() is not None else []
        return self._load(keys, pages)

    def batch_set_v1(self, keys: List[str], host_indices: "torch.Tensor",
                     extra_info: Optional["HiCacheStorageExtraInfo"] = None) -> List[bool]:
        t = self.mem_pool_host.page_size if self.mem_pool_host is not None else 1
        pages = [page_view(self.mem_pool_host, int(host_indices[i * t])) for i in range(len(keys))] \
            if self._ensure_session() is not None else []
        return self._save(keys, pages)

    # -- generic interface (flat data pages) --------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        res = self.batch_get([key], [target_location] if target_location is not None else None)
        return res[0] if isinstance(res, list) else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        if self._ensure_session() is None or target_locations is None:
            return [None] * len(keys)
        pages = [flat_page_view(self.mem_pool_host, t) for t in target_locations]
        ok = self._load(keys, pages)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if self._ensure_session() is None or values is None:
            return False
        pages = [flat_page_view(self.mem_pool_host, v) for v in values]
        return all(self._save(keys, pages))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        client, session = self._client, self._session  # close() may clear them meanwhile
        if client is not None and session is not None:
            self._guard.call("invalidate", lambda: client.invalidate(engine_id=session.engine_id), None)

    def get_stats(self):
        return {"calls": self._guard.stats.calls, "failures": self._guard.stats.failures,
                "skipped": self._guard.stats.skipped}

    def close(self) -> None:
        # SGLang's backup and prefetch threads may be mid-transfer: let them finish first, or one would see
        # the engine unregistered, register the closed staging file again, and copy through dropped views.
        with self._register_lock, self._set_lock, self._get_lock:
            client, session = self._client, self._session
            self._session = self._client = self._registration = None
            if client is not None:
                if session is not None:
                    self._guard.call("unregister", lambda: self._unregister(session.engine_id), None)
                self._guard.call("close", client.close, None)
            if self._staging is not None:
                self._k = self._v = []
                self._staging.close()
                self._staging = None

