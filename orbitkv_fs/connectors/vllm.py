"""vLLM adapter: :class:`OrbitKVConnector`, a ``KVConnectorBase_V1`` that stores prefix blocks in OrbitKV-FS.

Start vLLM with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OrbitKVConnector",
        "kv_connector_module_path": "orbitkv_fs.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"orbitkv.manager": "tcp://127.0.0.1:9092"}}'

Scheduler side: :meth:`~OrbitKVConnector.get_num_new_matched_tokens` asks the Manager for the leading run
of the prompt's block keys (on every pipeline stage's engine it knows, taking the shortest),
:meth:`~OrbitKVConnector.update_state_after_alloc` plans the load into the allocated blocks,
:meth:`~OrbitKVConnector.build_connector_meta` ships the step's loads and saves (full prompt blocks computed
this step) to the workers, :meth:`~OrbitKVConnector.request_finished` forgets the request. Worker side:
:meth:`~OrbitKVConnector.register_kv_caches` registers every layer's paged tensor (``[blocks, kv_heads,
block_size, 2 * head_dim]``, the ``vllm_packed`` layout) under the model's global layer index parsed from
vLLM's layer name (``model.layers.N.self_attn.attn``; a pipeline stage registers its own contiguous range)
through CUDA IPC handles; :meth:`~OrbitKVConnector.start_load_kv` hands the step's loads to a loader
thread, which restores them layer group by layer group in forward order (the Manager writes into the pages
itself); :meth:`~OrbitKVConnector.wait_for_layer_load` blocks only until that layer's group is written;
:meth:`~OrbitKVConnector.wait_for_save` waits for the loads, then saves the step's blocks;
a block that fails to load is reported by :meth:`~OrbitKVConnector.get_block_ids_with_load_errors` with
every later block of its request, so vLLM recomputes them (with ``kv_load_failure_policy: recompute``).

Layer groups: one per layer when the client's ``restore`` takes ``layers=`` (a Manager that restores a
subset of an engine's layers), else a single restore of every layer -- still off the calling thread, so
the forward pass launches its first kernels while the restore runs. ``"orbitkv.async_load": false`` loads
inside ``start_load_kv`` instead and lets vLLM keep full CUDA graphs (asynchronous loads make
:meth:`~OrbitKVConnector.requires_piecewise_for_cudagraph` true: a replayed full graph would skip the
per-layer waits).

Chunks: one per ``"orbitkv.chunk_tokens"`` tokens of a prompt (default 256: a multiple of the block size,
:data:`DEFAULT_CHUNK_TOKENS` rounded down to whole blocks, at least one block). Each chunk is one segment
per layer and K/V in the Manager, so a chunk of 16 blocks moves 16 times the bytes for the same
per-segment work as a chunk of one block (docs/engines.md); the prompt's last partial chunk is not stored.
vLLM's own prefix cache works in blocks: when it holds part of a chunk, that chunk is loaded with
:data:`~orbitkv_fs.manager.SKIP_BLOCK` at the blocks it holds (they may be shared with running requests and
are never written), and likewise past the last block vLLM may load.

Keys: by default the chained token-prefix keys of :func:`~orbitkv_fs.connectors.common.prefix_chunk_keys`
over whole chunks, salted with the model name (stable across processes and restarts);
``"orbitkv.key_source": "block_hashes"`` uses vLLM's own ``Request.block_hashes`` instead (the hash of a
chunk's last block, which chains the whole prefix; stable across processes only with a fixed
``PYTHONHASHSEED``).

Invariants: importing this module never imports vllm or torch when they are absent (the base class is
imported under a guard, so source-only tests can read the class); the storage tier never fails a request
-- an unreachable Manager or a bad segment is a miss that vLLM recomputes, and a Manager that restarted
gets the worker registered again on its next call; a step's loads have ended before its saves start and
before its load errors are reported, and no load outlives the step (no blocks held after a step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .common import (
    EngineSession,
    LayerLoadJob,
    LayerLoader,
    ManagerGuard,
    PrefixPlanner,
    Transfer,
    connect_client,
    engine_hash_keys,
    layer_index,
    packed_registration,
    ping_probe,
    prefix_chunk_keys,
    register_session,
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
#: Tokens per chunk unless ``orbitkv.chunk_tokens`` says otherwise (rounded down to whole blocks).
DEFAULT_CHUNK_TOKENS = 256


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
    """The Manager engine id of one TP/PP rank; the scheduler looks up on the TP-rank-0 engine of every
    pipeline stage."""
    return f"{base}-tp{tp_rank}-pp{pp_rank}"


def _total_layers(model_config: Any) -> int | None:
    """The model's hidden layer count (all pipeline stages together), None when the config does not say."""
    get = getattr(model_config, "get_total_num_hidden_layers", None)
    if callable(get):
        return int(get())
    n = getattr(getattr(model_config, "hf_config", None), "num_hidden_layers", None)
    return int(n) if n is not None else None


def chunk_blocks_for(block_size: int, chunk_tokens: Any) -> int:
    """Blocks per chunk: ``chunk_tokens`` (a multiple of ``block_size``), or when None the default's whole
    blocks (at least one)."""
    if chunk_tokens is None:
        return max(1, DEFAULT_CHUNK_TOKENS // block_size)
    n = int(chunk_tokens)
    if n <= 0 or n % block_size:
        raise ValueError(f"orbitkv.chunk_tokens must be a positive multiple of the block size {block_size}, "
                         f"not {chunk_tokens!r}")
    return n // block_size


def _flag(value: Any) -> bool:
    """A boolean extra-config value (JSON gives bools; a CLI string "false"/"0" must not read as True)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


class OrbitKVConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    """vLLM v1 KV connector backed by an OrbitKV-FS Manager (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self._model_name = str(getattr(model, "model", "model"))
        self._revision = str(getattr(model, "revision", None) or "")
        self._num_layers = _total_layers(model)
        self._salt = f"{self._model_name}@{self._revision}".encode()
        self._key_source = _extra(vllm_config, "key_source", "tokens")
        if self._key_source not in ("tokens", "block_hashes"):
            raise ValueError(f"orbitkv.key_source must be 'tokens' or 'block_hashes', not {self._key_source!r}")
        self._address = _extra(vllm_config, "manager", os.environ.get("ORBITKV_MANAGER", "tcp://127.0.0.1:9092"))
        self._codec = _extra(vllm_config, "codec", None)
        self._http = _extra(vllm_config, "http", None)
        self._async_load = _flag(_extra(vllm_config, "async_load", True))
        parallel = vllm_config.parallel_config
        tp = max(int(parallel.tensor_parallel_size), 1)
        pp = max(int(parallel.pipeline_parallel_size), 1)
        rank = int(getattr(parallel, "rank", 0))
        # vLLM's rank layout is DP x PP x TP (ModelConfig.get_layers_start_end_indices).
        self._tp_rank, self._tp_size = rank % tp, tp
        self._pp_rank, self._pp_size = (rank // tp) % pp, pp
        self._base_id = self._engine_base(vllm_config)
        self._guard = ManagerGuard(cooldown_s=float(_extra(vllm_config, "cooldown_s", 5.0)),
                                   probe=ping_probe(self._address))
        self._timeout_s = float(_extra(vllm_config, "timeout_s", 30.0))
        # The scheduler blocks every request on a lookup: a Manager that went away must cost it seconds.
        self._lookup_timeout_s = float(_extra(vllm_config, "lookup_timeout_s", 5.0))
        self._client: Any = None
        self._scheduler_engine_ids = [engine_id_for(self._base_id, 0, r) for r in range(self._pp_size)]
        self._worker_engine_id = engine_id_for(self._base_id, self._tp_rank, self._pp_rank)
        self._chunk_blocks = chunk_blocks_for(self._block_size, _extra(vllm_config, "chunk_tokens", None))
        self._planner = PrefixPlanner(self._block_size, self._chunk_blocks)
        self._session: EngineSession | None = None
        self._stage_sessions: list[EngineSession] = []
        self._load_errors: set[int] = set()
        self._kv_caches: dict[str, Any] = {}
        self._layer_of: dict[str, int] = {}
        self._loader: LayerLoader | None = None
        self._load_job: LayerLoadJob | None = None
        self._registration: Any = None
        self._unregister: Any = None
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        # Block ids are per KV cache group; a flat block list fits one group only (vLLM disables its hybrid
        # allocator for connectors without SupportsHMA, so this holds unless a model needs several).
        self._enabled = groups is None or len(groups) <= 1
        if not self._enabled:
            log.warning("OrbitKV-FS disabled: %d KV cache groups (one is supported)", len(groups))
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and not self._role_is_worker():
            log.warning("OrbitKV-FS: kv_load_failure_policy is %r, so a block evicted between lookup and load "
                        "fails its request; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config "
                        "to have vLLM recompute it", policy)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Asynchronous loads are waited for per layer (``wait_for_layer_load``), which a full CUDA graph
        would skip on replay: attention could read blocks still being written."""
        return _flag((extra_config or {}).get(EXTRA_PREFIX + "async_load", True))

    def _engine_base(self, vllm_config: "VllmConfig") -> str:
        """Base of this vLLM instance's engine ids: ``orbitkv.engine_id``, else the model and the instance's
        ``kv_transfer_config.engine_id`` (a UUID shared by its scheduler and workers, so two servers of one
        model on one host do not collide), plus the data-parallel rank when there are several."""
        base = _extra(vllm_config, "engine_id", None)
        if base is None:
            base = f"vllm-{self._model_name.replace('/', '-')}"
            instance = getattr(vllm_config.kv_transfer_config, "engine_id", None)
            if instance:
                base += f"-{str(instance)[:12]}"
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1:
            base += f"-dp{int(getattr(parallel, 'data_parallel_rank', 0) or 0)}"
        return base

    # -- plumbing -----------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        if self._client is None:
            timeout = self._timeout_s if self._role_is_worker() else self._lookup_timeout_s
            self._client = self._guard.call("connect", lambda: connect_client(self._address, timeout_s=timeout), None)
        return self._client

    def _scheduler_sessions(self) -> list[EngineSession]:
        if not self._stage_sessions and self._enabled:
            client = self._get_client()
            if client is not None:
                self._stage_sessions = [EngineSession(client, e, guard=self._guard)
                                        for e in self._scheduler_engine_ids]
        return self._stage_sessions

    def _keys_for(self, request: "Request") -> list[bytes]:
        known = self._planner.keys(request.request_id)
        if known is not None:
            return known
        g = self._chunk_blocks
        if self._key_source == "block_hashes":
            # A chunk's key is its last block's hash; the chunk size in the salt keeps a one-block chunk
            # and the chunk ending at that block apart (their segments differ in size).
            salt = self._salt if g == 1 else self._salt + b"/chunk_blocks=%d" % g
            return engine_hash_keys(list(request.block_hashes)[g - 1::g], salt=salt)
        return prefix_chunk_keys(list(request.prompt_token_ids or []), self._block_size * g, salt=self._salt)

    # -- scheduler side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        keys = self._keys_for(request)
        sessions = self._scheduler_sessions()
        # An engine the Manager does not know (restarted, the worker has not registered again yet) is a
        # miss, not an outage that would cool the scheduler down.
        hit = sessions[0].lookup(keys, if_unknown=0) if sessions else 0
        # Each pipeline stage stores its own layers: a block is loadable only where every stage has it. A
        # stage registered with another host's Manager is not known here; its worker reports what it misses.
        for session in sessions[1:]:
            if hit == 0:
                break
            hit = min(hit, session.lookup(keys[:hit], if_unknown=hit))
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
        self._kv_caches = dict(kv_caches)  # the Manager maps this memory: hold it while registered
        layers = [layer_index(name) for name in kv_caches]
        if None in layers or sorted(layers) != list(range(min(layers), max(layers) + 1)):  # type: ignore[type-var,arg-type]
            if self._pp_size > 1:
                log.warning("OrbitKV-FS disabled for this worker: layer names %s do not number one contiguous "
                            "pipeline stage", list(kv_caches))
                return
            layers = list(range(len(kv_caches)))  # one stage: the model's order is the layer order
        self._layer_of = dict(zip(kv_caches, layers))  # type: ignore[arg-type]
        if not self._enabled:
            return
        reg = packed_registration(
            kv_caches, layers=layers, num_layers=self._num_layers if self._pp_size > 1 else None,  # type: ignore[arg-type]
            model=self._model_name, model_revision=self._revision, block_size=self._block_size, engine_kind="vllm",
            engine_id=self._worker_engine_id, tp_rank=self._tp_rank, tp_size=self._tp_size, pp_rank=self._pp_rank,
            pp_size=self._pp_size, codec=self._codec, lookup_by_user=True)  # the scheduler looks up in its name
        if reg is None:
            log.warning("OrbitKV-FS disabled for this worker: its KV caches are not in a layout or memory the "
                        "Manager can import")
            return
        self._registration = reg
        if self._async_load:
            self._loader = LayerLoader(f"orbitkv-load-tp{self._tp_rank}-pp{self._pp_rank}")
        if self._worker_session() is None:
            log.warning("OrbitKV-FS: registering %s with the Manager at %s failed (%s); retrying on later steps. "
                        "An engine id still registered by a crashed worker is freed with DELETE /v1/engines/{id}",
                        self._worker_engine_id, self._address, self._guard.stats.last_error)

    def _worker_session(self) -> EngineSession | None:
        """This worker's registered session; registers first when that has not succeeded yet (a Manager
        started after vLLM, or down at start), at most once per guard cool-down."""
        if self._session is not None or self._registration is None:
            return self._session
        client = self._get_client()
        if client is None:
            return None
        self._session, self._unregister = register_session(client, self._registration, self._http, self._guard,
                                                           timeout_s=self._timeout_s)
        return self._session

    def _load_groups(self) -> list[list[int]]:
        """Layer groups in forward order: one per layer (each layer's wait needs only its own restore)."""
        return [[layer] for layer in sorted(set(self._layer_of.values()))]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, OrbitKVConnectorMetadata) or not meta.loads:
            return
        self._finish_load()  # a step's loads never overlap the next step's
        session = self._worker_session()
        if session is not None:
            # The Manager writes the blocks from its own process, outside vLLM's stream order: whatever vLLM
            # queued that may touch them (block zeroing and copies of this step, an earlier step's tail
            # under async scheduling) must have run first.
            _sync_device()
        job = LayerLoadJob(session, meta.loads, self._load_groups())
        if self._loader is None or session is None:
            job.run()
        else:
            self._loader.start(job)
        self._load_job = job

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load_job
        if job is not None:
            job.wait_layer(self._layer_of.get(layer_name))

    def _finish_load(self) -> None:
        """Wait for this step's loads and keep their failed blocks for get_block_ids_with_load_errors."""
        job, self._load_job = self._load_job, None
        if job is not None:
            self._load_errors |= job.wait()

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # The Manager reads the registered pages itself after the step (wait_for_save); nothing per layer.
        return None

    def wait_for_save(self):
        self._finish_load()
        meta = self._connector_metadata
        if not isinstance(meta, OrbitKVConnectorMetadata) or not meta.saves:
            return
        session = self._worker_session()
        if session is None:
            return
        _sync_device()
        for t in meta.saves:
            session.save(t.keys, t.blocks)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks for these before wait_for_save when it defers finalisation (speculative decoding).
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()  # an in-flight restore writes into pages the Manager must stop touching first
        try:
            self._finish_load()
        except Exception:  # a load bug surfaces in the step; at shutdown only the cleanup matters
            log.exception("OrbitKV-FS: load failed during shutdown")
        client, self._client = self._client, None
        if client is None:
            return
        if self._role_is_worker() and self._session is not None:
            # Frees the engine id for the next worker process; the cached objects stay (namespace-owned).
            unregister, session = self._unregister, self._session  # both set when the session was made
            self._guard.call("unregister", lambda: unregister(session.engine_id), None)
        self._session = None
        self._stage_sessions = []
        self._guard.call("close", client.close, None)

    def _role_is_worker(self) -> bool:
        return getattr(self._role, "name", self._role) in ("WORKER", "worker")


def _sync_device() -> None:
    """Wait for the work queued on the current CUDA stream: the Manager reads and writes the pages from
    another process, outside that stream's order."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
