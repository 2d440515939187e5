"""Hugging Face transformers adapter: save a ``DynamicCache`` prefix after prefill, restore it before generation.

For offline batch inference and for the project's own end-to-end tests::

    store = HFPrefixStore.for_model(client, model, block_size=16, model="org/name")
    cache, n = store.restore(input_ids)          # n cached prompt tokens, or (None, 0)
    out = model.generate(input_ids, past_key_values=cache, ...)   # computes only tokens [n:]
    store.save(input_ids, out.past_key_values)   # or after a plain prefill

A prompt is cut into blocks of ``block_size`` tokens; block ``i`` is stored under the chained key of
``tokens[: (i + 1) * block_size]`` (:func:`~orbitkv_fs.connectors.common.prefix_chunk_keys`, salted with
the model's identity and, given ``inputs=KVInputs(...)``, the LoRA adapter, ``cache_salt`` and multimodal
inputs of the request), per layer as K and V segments. transformers keeps KV in ordinary tensors the Manager
cannot import, so the adapter stages blocks in a shared-memory pages file it registers with the Manager
(:class:`~orbitkv_fs.connectors.common.StagingPages`, ``vllm_packed`` layout ``[slot, head, token,
2 * head_dim]``) and copies KV in before a save and out after a restore.

Invariants: only full blocks are stored; a restore returns at most ``len(prompt) - 1`` tokens (the model
must compute the last prompt token to produce logits) and stops at the first block that missed (a bad or
corrupt segment is a miss, and everything after it is recomputed); a Manager failure is a miss, never an
exception into generation; torch is imported only when an adapter is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import (
    BlockMath,
    EngineSession,
    KVInputs,
    ManagerGuard,
    StagingPages,
    packed_registration,
    ping_probe,
    prefix_chunk_keys,
    register_session,
)

__all__ = ["HFPrefixStore", "model_geometry"]


def model_geometry(model: Any) -> dict[str, Any]:
    """``num_layers``, ``num_heads`` (KV heads), ``head_dim``, ``dtype`` and ``model`` of a causal LM."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    name = getattr(c, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__
    return {"num_layers": int(c.num_hidden_layers), "num_heads": int(heads), "head_dim": int(head_dim),
            "dtype": str(model.dtype).removeprefix("torch."), "model": str(name)}


def _as_torch(a: np.ndarray, dtype: Any) -> Any:
    """A torch view of a numpy array of ``dtype`` (bfloat16 goes through int16: numpy has no bf16)."""
    import torch

    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class HFPrefixStore:
    """Prefix KV of one transformers model in an OrbitKV-FS Manager (see the module docstring)."""

    def __init__(self, client: Any, *, model: str, num_layers: int, num_heads: int, head_dim: int, dtype: str,
                 block_size: int = 16, slots: int = 64, codec: str | None = None, engine_id: str | None = None,
                 model_revision: str = "", config: Any = None, compute_dtype: str | None = None,
                 device: str = "cpu", http: str | None = None) -> None:
        """``dtype`` is the KV cache dtype (what is stored); ``compute_dtype`` the model's, when it differs
        (then :meth:`new_cache` rounds every K/V to ``dtype`` as it enters the cache, as an engine with a
        narrower KV cache dtype does, so saved and restored KV are the values attention used). With a CUDA
        ``device`` the staging pages live on that GPU and are registered through CUDA IPC. ``http`` (the
        Manager's control plane, e.g. ``127.0.0.1:9091``) registers over REST instead of the client."""
        import torch

        self.math = BlockMath(block_size)
        self.block_size = block_size
        self._torch_dtype = getattr(torch, dtype)
        self._compute_dtype = getattr(torch, compute_dtype or dtype)
        self._config = config
        self._salt = f"{model}@{model_revision}".encode()
        self.device = torch.device(device)
        self.staging: StagingPages | None = None
        if self.device.type == "cpu":
            self.staging = StagingPages(num_layers=num_layers, slots=slots, block_size=block_size,
                                        num_heads=num_heads, head_dim=head_dim, dtype=dtype)
            self._k = [_as_torch(self.staging.key(i), self._torch_dtype) for i in range(num_layers)]
            self._v = [_as_torch(self.staging.value(i), self._torch_dtype) for i in range(num_layers)]
            reg = self.staging.registration(model=model, engine_kind="transformers", codec=codec,
                                            engine_id=engine_id, model_revision=model_revision)
        else:
            # GPU staging: one allocation (one CUDA IPC handle) holding every layer's packed pages; the
            # Manager imports it and runs the GPU codecs on it in its own process.
            self._gpu = torch.zeros((num_layers, slots, num_heads, block_size, 2 * head_dim), dtype=self._torch_dtype,
                                    device=self.device)
            layers = {f"L{i}": self._gpu[i] for i in range(num_layers)}
            self._k = [t[..., :head_dim] for t in layers.values()]
            self._v = [t[..., head_dim:] for t in layers.values()]
            reg = packed_registration(layers, model=model, block_size=block_size, engine_kind="transformers",
                                      codec=codec, engine_id=engine_id, model_revision=model_revision)
        self.slots = slots
        self.guard = ManagerGuard(probe=ping_probe(getattr(client, "endpoint", None) or client))
        self.engine_info = None
        self.session: EngineSession | None = None
        if reg is not None:
            self.session, self._unregister = register_session(client, reg, http, self.guard,
                                                              on_info=lambda info: setattr(self, "engine_info", info))
        self.client = client

    @classmethod
    def for_model(cls, client: Any, lm: Any, /, **overrides: Any) -> "HFPrefixStore":
        """A store with the geometry of the causal LM ``lm``; ``overrides`` replace any argument (e.g.
        ``model=`` a stable model name when the loaded path is machine-specific)."""
        args = model_geometry(lm)
        args["config"] = lm.config
        args["compute_dtype"] = args["dtype"]
        args["device"] = str(getattr(lm, "device", "cpu"))
        args.update(overrides)
        return cls(client, **args)

    def new_cache(self) -> Any:
        """An empty cache of the right kind: a ``DynamicCache``, rounding K/V to the KV dtype when the
        model computes in a wider one."""
        if self._torch_dtype == self._compute_dtype:
            from transformers import DynamicCache

            return DynamicCache(config=self._config) if self._config is not None else DynamicCache()
        return _rounded_cache_class()(self._torch_dtype, config=self._config)

    # -- keys ---------------------------------------------------------------------------------------

    def keys(self, input_ids: Any, inputs: KVInputs | None = None) -> list[bytes]:
        """Chunk keys of ``input_ids``; ``inputs`` are what else changes its KV (a LoRA adapter loaded into
        the model, a tenant's ``cache_salt``, multimodal inputs behind placeholder tokens)."""
        return prefix_chunk_keys(_token_list(input_ids), self.block_size, salt=self._salt, inputs=inputs)

    def cached_tokens(self, input_ids: Any, inputs: KVInputs | None = None) -> int:
        """Prompt tokens a :meth:`restore` would return now (leading hit, leaving one token to compute)."""
        if self.session is None:
            return 0
        ids = _token_list(input_ids)
        keys = self.keys(ids, inputs)[: self.math.loadable_blocks(len(ids), len(ids))]
        return self.math.loadable_blocks(len(ids), self.session.lookup(keys)) * self.block_size

    # -- save / restore -----------------------------------------------------------------------------

    def save(self, input_ids: Any, cache: Any, inputs: KVInputs | None = None) -> int:
        """Store the full blocks of ``input_ids`` that ``cache`` holds and the Manager lacks.

        Returns the number of prompt tokens now stored (leading blocks), 0 when the Manager is away.
        """
        import torch

        if self.session is None:
            return 0
        ids = _token_list(input_ids)
        layers = _cache_layers(cache)
        have = min(len(ids), int(layers[0][0].shape[-2]))
        keys = self.keys(ids[:have], inputs)
        start = self.session.lookup(keys)
        slots = self.slots
        for first in range(start, len(keys), slots):
            end = min(first + slots, len(keys))
            n = end - first
            t0, t1 = first * self.block_size, end * self.block_size
            for layer, (k, v) in enumerate(layers):
                # [1, heads, tokens, head_dim] -> [blocks, block_size, heads, head_dim]
                # [1, heads, tokens, head_dim] -> [blocks, heads, block_size, head_dim]
                shape = (k.shape[1], n, self.block_size, k.shape[3])
                self._k[layer][:n] = k[0, :, t0:t1].reshape(shape).transpose(0, 1)
                self._v[layer][:n] = v[0, :, t0:t1].reshape(shape).transpose(0, 1)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the Manager reads the pages from another process
            res = self.session.save(keys[first:end], [[s] for s in range(n)])
            if res is None or res.dropped_segments:  # unreachable, or no room for some of this round
                return first * self.block_size
        return len(keys) * self.block_size

    def restore(self, input_ids: Any, inputs: KVInputs | None = None) -> tuple[Any, int]:
        """A fresh ``DynamicCache`` holding the longest stored prefix of ``input_ids``, and its length.

        ``(None, 0)`` when nothing usable is stored. The prefix ends at the first block that missed.
        """
        import torch

        if self.session is None:
            return None, 0
        ids = _token_list(input_ids)
        keys = self.keys(ids, inputs)[: self.math.loadable_blocks(len(ids), len(ids))]
        hit = self.session.lookup(keys)
        keys = keys[:hit]
        if not keys:
            return None, 0
        n_layers = len(self._k)
        ks: list[list[Any]] = [[] for _ in range(n_layers)]
        vs: list[list[Any]] = [[] for _ in range(n_layers)]
        got = 0
        slots = self.slots
        for first in range(0, len(keys), slots):
            part = keys[first : first + slots]
            missed = set(self.session.restore(part, [[s] for s in range(len(part))]))
            ok = next((i for i, k in enumerate(part) if k in missed), len(part))
            for layer in range(n_layers):
                ks[layer].append(self._k[layer][:ok].clone())
                vs[layer].append(self._v[layer][:ok].clone())
            got += ok
            if ok < len(part):
                break
        if got == 0:
            return None, 0
        cache = self.new_cache()
        heads, head_dim = self._k[0].shape[1], self._k[0].shape[3]
        for layer in range(n_layers):
            # [blocks, heads, block_size, head_dim] -> [1, heads, tokens, head_dim]
            k = torch.cat(ks[layer]).transpose(0, 1).reshape(1, heads, got * self.block_size, head_dim)
            v = torch.cat(vs[layer]).transpose(0, 1).reshape(1, heads, got * self.block_size, head_dim)
            cache.update(k.to(self._compute_dtype).contiguous(), v.to(self._compute_dtype).contiguous(), layer)
        return cache, got * self.block_size

    @property
    def engine_id(self) -> str | None:
        """The Manager's id of this store's engine (it changes when a restarted Manager registers it again)."""
        return self.session.engine_id if self.session is not None else None

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.guard.call("unregister", lambda: self._unregister(session.engine_id), None)
        self._k = self._v = []
        self._gpu = None
        if self.staging is not None:
            self.staging.close()

    def __enter__(self) -> "HFPrefixStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ROUNDED: list[type] = []


def _rounded_cache_class() -> type:
    """``DynamicCache`` subclass storing K/V rounded to a narrower dtype (built once, transformers lazily)."""
    if not _ROUNDED:
        from transformers import DynamicCache

        class RoundedKVCache(DynamicCache):
            def __init__(self, kv_dtype: Any, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.kv_dtype = kv_dtype

            def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
                k = key_states.to(self.kv_dtype).to(key_states.dtype)
                v = value_states.to(self.kv_dtype).to(value_states.dtype)
                return super().update(k, v, layer_idx, *args, **kwargs)

        _ROUNDED.append(RoundedKVCache)
    return _ROUNDED[0]


def _token_list(input_ids: Any) -> list[int]:
    """Token ids of one sequence: a list, a 1-D tensor/array or a ``[1, n]`` batch."""
    if hasattr(input_ids, "tolist"):
        input_ids = input_ids.tolist()
    if input_ids and isinstance(input_ids[0], list):
        if len(input_ids) != 1:
            raise ValueError(f"HFPrefixStore handles one sequence at a time, got a batch of {len(input_ids)}")
        input_ids = input_ids[0]
    return [int(t) for t in input_ids]


def _cache_layers(cache: Any) -> Sequence[tuple[Any, Any]]:
    """(key, value) tensors ``[batch, heads, tokens, head_dim]`` per layer of a transformers cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]
