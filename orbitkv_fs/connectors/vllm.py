"""vLLM adapter: :class:`OrbitKVConnector`, a ``KVConnectorBase_V1`` that stores prefix blocks in OrbitKV-FS.

Start vLLM with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OrbitKVConnector",
        "kv_connector_module_path": "orbitkv_fs.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"orbitkv.manager": "tcp://127.0.0.1:9092"}}'

Scheduler side: :meth:`~OrbitKVConnector.get_num_new_matched_tokens` asks the Manager for the leading run
of the prompt's block keys, :meth:`~OrbitKVConnector.update_state_after_alloc` plans the load into the
allocated blocks, :meth:`~OrbitKVConnector.build_connector_meta` ships the step's loads and saves (full
prompt blocks computed this step) to the workers, :meth:`~OrbitKVConnector.request_finished` forgets the
request. Worker side: :meth:`~OrbitKVConnector.register_kv_caches` registers every layer's paged tensor
(``[blocks, kv_heads, block_size, 2 * head_dim]``, the ``vllm_packed`` layout) with the Manager through
CUDA IPC handles; :meth:`~OrbitKVConnector.start_load_kv` restores the step's loads (the Manager writes
into the pages itself), :meth:`~OrbitKVConnector.wait_for_save` saves the step's blocks after the forward
pass; a block that fails to load is reported by
:meth:`~OrbitKVConnector.get_block_ids_with_load_errors` so vLLM recomputes it.

Keys: one chunk per vLLM block; by default the chained token-prefix keys of
:func:`~orbitkv_fs.connectors.common.prefix_chunk_keys` salted with the model name (stable across
processes and restarts); ``"orbitkv.key_source": "block_hashes"`` uses vLLM's own ``Request.block_hashes``
instead (stable across processes only with a fixed ``PYTHONHASHSEED``).

Invariants: importing this module never imports vllm or torch when they are absent (the base class is
imported under a guard, so source-only tests can read the class); the storage tier never fails a request
-- an unreachable Manager or a bad segment is a miss that vLLM recomputes; loads complete inside
``start_load_kv`` and saves inside ``wait_for_save`` (synchronous connector, no blocks held after a step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .common import (
    EngineSession,
    ManagerGuard,
    PrefixPlanner,
    RestRegistrar,
    Transfer,
    connect_client,
    engine_hash_keys,
    failed_blocks,
    packed_cuda_registration,
    prefix_chunk_keys,
)

try:  # vLLM is optional: without it the class still imports (and is checked against the wheel's source).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError:  # exercised where vLLM is absent (CI): enough of the base to drive the class

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in with the real base's constructor state and metadata binding (vLLM not installed)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

    KVConnectorMetadata = object  # type: ignore[assignment,misc]
    KVConnectorRole = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

EXTRA_PREFIX = "orbitkv."


@dataclass
class OrbitKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,valid-type]
    """Scheduler -> worker: this step's loads (before the forward) and saves (after it)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _extra(config: Any, key: str, default: Any) -> Any:
    ktc = config.kv_transfer_config
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    return extra.get(EXTRA_PREFIX + key, default)


def engine_id_for(base: str, tp_rank: int, pp_rank: int) -> str:
    """The Manager engine id of one TP/PP rank; the scheduler looks up on rank (0, pp_rank)."""
    return f"{base}-tp{tp_rank}-pp{pp_rank}"


class OrbitKVConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    """vLLM v1 KV connector backed by an OrbitKV-FS Manager (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self._model_name = str(getattr(model, "model", "model"))
        self._revision = str(getattr(model, "revision", None) or "")
        self._salt = f"{self._model_name}@{self._revision}".encode()
        self._key_source = _extra(vllm_config, "key_source", "tokens")
        if self._key_source not in ("tokens", "block_hashes"):
            raise ValueError(f"orbitkv.key_source must be 'tokens' or 'block_hashes', not {self._key_source!r}")
        self._address = _extra(vllm_config, "manager", os.environ.get("ORBITKV_MANAGER", "tcp://127.0.0.1:9092"))
        self._codec = _extra(vllm_config, "codec", None)
        self._http = _extra(vllm_config, "http", None)
        base_id = _extra(vllm_config, "engine_id", f"vllm-{self._model_name.replace('/', '-')}")
        parallel = vllm_config.parallel_config
        self._tp_rank = int(getattr(parallel, "rank", 0)) % max(int(parallel.tensor_parallel_size), 1)
        self._tp_size = int(parallel.tensor_parallel_size)
        self._pp_rank = int(getattr(parallel, "rank", 0)) // max(int(parallel.tensor_parallel_size), 1)
        self._pp_size = int(parallel.pipeline_parallel_size)
        self._guard = ManagerGuard(cooldown_s=float(_extra(vllm_config, "cooldown_s", 5.0)))
        self._timeout_s = float(_extra(vllm_config, "timeout_s", 30.0))
        self._client: Any = None
        self._scheduler_engine_id = engine_id_for(base_id, 0, 0)
        self._worker_engine_id = engine_id_for(base_id, self._tp_rank, self._pp_rank)
        self._planner = PrefixPlanner(self._block_size)
        self._session: EngineSession | None = None
        self._load_errors: set[int] = set()
        self._kv_caches: dict[str, Any] = {}

    # -- plumbing -----------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        if self._client is None:
            self._client = self._guard.call("connect", lambda: connect_client(self._address, timeout_s=self._timeout_s), None)
        return self._client

    def _scheduler_session(self) -> EngineSession | None:
        if self._session is None:
            client = self._get_client()
            if client is not None:
                self._session = EngineSession(client, self._scheduler_engine_id, guard=self._guard)
        return self._session

    def _keys_for(self, request: "Request") -> list[bytes]:
        if self._key_source == "block_hashes":
            return engine_hash_keys(request.block_hashes, salt=self._salt)
        return prefix_chunk_keys(list(request.prompt_token_ids or []), self._block_size, salt=self._salt)

    # -- scheduler side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        keys = self._keys_for(request)
        session = self._scheduler_session()
        hit = session.lookup(keys) if session is not None else 0
        n_prompt = len(request.prompt_token_ids or [])
        return self._planner.matched(request.request_id, keys, n_prompt, num_computed_tokens, hit), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        if num_external_tokens > 0:
            self._planner.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> "KVConnectorMetadata":
        for new in scheduler_output.scheduled_new_reqs:
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._planner.scheduled(new.req_id, done, new.block_ids[0], replace_blocks=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._planner.scheduled(req_id, done, new_ids[0] if new_ids else [],
                                    replace_blocks=req_id in cached.resumed_req_ids)
        loads, saves = self._planner.take()
        return OrbitKVConnectorMetadata(loads=loads, saves=saves)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._planner.finished(request.request_id)
        return False, None

    # -- worker side --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._kv_caches = dict(kv_caches)
        reg = packed_cuda_registration(
            kv_caches, model=self._model_name, model_revision=self._revision, block_size=self._block_size,
            engine_kind="vllm",
            engine_id=self._worker_engine_id, tp_rank=self._tp_rank, tp_size=self._tp_size, pp_rank=self._pp_rank,
            pp_size=self._pp_size, codec=self._codec)
        client = self._get_client()
        if client is None or reg is None:
            log.warning("OrbitKV-FS disabled for this worker (no Manager at %s or unsupported layout)", self._address)
            return
        if self._http:
            rest = RestRegistrar(self._http, timeout_s=self._timeout_s)
            engine_id = self._guard.call("register", lambda: rest.register(reg), None)
            self._unregister = rest.unregister
        else:
            info = self._guard.call("register", lambda: client.register(reg), None)
            engine_id = info.engine_id if info is not None else None
            self._unregister = client.unregister
        if engine_id is not None:
            self._session = EngineSession(client, engine_id, guard=self._guard)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, OrbitKVConnectorMetadata) or not meta.loads:
            return
        for t in meta.loads:
            if self._session is None:
                missed = list(t.keys)
            else:
                missed = self._session.restore(t.keys, t.blocks)
            if missed:
                self._load_errors.update(failed_blocks(t.keys, [b[0] for b in t.blocks], missed))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish inside start_load_kv: the Manager writes every layer before it answers.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # The Manager reads the registered pages itself after the step (wait_for_save); nothing per layer.
        return None

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, OrbitKVConnectorMetadata) or not meta.saves or self._session is None:
            return
        _sync_device()
        for t in meta.saves:
            self._session.save(t.keys, t.blocks)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        client, self._client = self._client, None
        if client is None:
            return
        if self._role_is_worker() and self._session is not None:
            # Frees the engine id for the next worker process; the cached objects stay (namespace-owned).
            unregister = getattr(self, "_unregister", client.unregister)
            self._guard.call("unregister", lambda: unregister(self._session.engine_id), None)
        self._session = None
        self._guard.call("close", client.close, None)

    def _role_is_worker(self) -> bool:
        return getattr(self._role, "name", self._role) in ("WORKER", "worker")


def _sync_device() -> None:
    """The forward pass wrote the pages on the current stream; the Manager reads them from another
    process, so the writes must be complete first."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
