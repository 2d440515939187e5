"""``orbitkv-bench cohort``: the serving benchmark under memory pressure, with a real model forward pass.

Question answered: per codec, does restoring a prefix's KV through OrbitKV-FS give a shorter time to
first token and more requests per second than recomputing it, and than storing it uncompressed
(``none``), when the engine's HBM prefix cache and the Manager's DRAM are too small for the working set?

Owns the recipe (:class:`Recipe`, :data:`FULL` and :data:`QUICK`), the request cohort
(:func:`build_cohort`), a minimal paged engine around a transformers causal LM (:class:`Engine`), one
run of the cohort against one configuration (:func:`run_cohort`), the whole benchmark (:func:`benchmark`),
its verdicts (:func:`verdicts`), its report (JSON, markdown table, PNG plots; :func:`write_report`) and the
merge of separate invocations into one report (:func:`merge`).

The engine (one per run, fresh caches):

* KV pages: one ``vllm_packed`` tensor ``[blocks, kv_heads, block_size, 2 * head_dim]`` per layer, in a
  host pages file (CPU) or in CUDA memory registered through CUDA IPC (GPU, Manager in its own process).
* HBM prefix cache: an LRU of chunks (``chunk_tokens`` each) holding at most ``hbm_tokens`` tokens of
  pages, standing for the engine's own prefix cache. Pages in use by a running request are pinned.
* A request: leading chunks found in the HBM cache; the next ones through ``lookup`` + ``restore`` into
  free pages; the remainder is prefilled by the real model on a ``DynamicCache`` built from the pages
  (at least the last prompt token is always computed, as engines do); then greedy decoding. TTFT is
  lookup + restore + page gather + wait for the step lock + prefill, up to the first token on the host.
  Newly computed chunks are written to pages, saved to the Manager (after generation, so not in TTFT, but
  in the throughput) and become HBM cache entries.
* Model steps: forward passes run one at a time, in arrival order, under an engine-wide FIFO lock
  (:class:`StepLock`), as an engine's scheduler runs one model step at a time; there is no batching, so a
  request's prefill and each of its decode steps is a forward of its own, and concurrent requests' decode
  steps interleave round robin. Lookup, restore, page gather and scatter and the Manager save run outside
  the lock, concurrently with other requests' forwards (on a GPU on each worker's own CUDA stream), as an
  engine loads KV asynchronously. Forwards left to overlap on per-worker streams were interleaved by the GPU
  kernel by kernel: a one-token forward waited behind other requests' prefill GEMMs and took as long as a
  whole prefill, so a restored prefix could not shorten TTFT.
* A reuse request waits until the first request of its prefix has finished, so the cohort's reuse is the
  same in every run; two requests never compute the same prefix at once.

Invariants checked and reported per run: the Manager's reserved bytes, leases, workspace bytes and in-flight
requests are zero at the end; every request's prompt tokens are split exactly into HBM, DRAM, SSD
(lower tier) and computed tokens; only reuse requests can hit.

torch and transformers are imported inside functions: importing this module needs only the core.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from orbitkv_fs.console import HelpFormatter
from orbitkv_fs.progress import progress
from orbitkv_fs.provenance import code_identity

__all__ = ["FULL", "QUICK", "Engine", "Recipe", "RequestSpec", "across_rounds", "benchmark", "build_cohort", "main",
           "merge", "run_cohort", "verdicts", "write_report"]

CODECS = ("none", "ans", "fp8", "turboquant-4", "turboquant-3")
LOSSY = ("fp8", "turboquant-4", "turboquant-3")


# ---------------------------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-style decoder; weights are random (timing and real activations, not quality)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int


QWEN3_8B = ModelShape("qwen3-8b", layers=36, kv_heads=8, head_dim=128, hidden=4096, heads=32, intermediate=12288,
                      vocab=151936)
QWEN3_TINY = ModelShape("qwen3-tiny", layers=8, kv_heads=2, head_dim=64, hidden=256, heads=4, intermediate=768,
                        vocab=2048)
SHAPES = {s.name: s for s in (QWEN3_8B, QWEN3_TINY)}


@dataclass(frozen=True)
class Recipe:
    requests: int = 64
    concurrency: int = 4
    input_tokens: int = 4096
    output_tokens: int = 16
    #: Requests that reuse one of ``prefixes`` shared prefixes; the others are cold (unique prompts).
    warm_requests: int = 49
    prefixes: int = 12
    #: Unique tokens after the shared prefix of a reuse request (0: the whole prompt is the prefix).
    suffix_tokens: int = 0
    chunk_tokens: int = 256
    block_size: int = 16
    hbm_tokens: int = 8192
    dram_bytes: int = 1 << 30
    ssd_bytes: int = 8 << 30
    #: DRAM of the DRAM-only variant (no SSD).
    dram_only_bytes: int = 8 << 30
    model: ModelShape = QWEN3_8B
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.requests > 0 and self.concurrency > 0, "requests and concurrency must be positive"),
            (0 <= self.warm_requests <= self.requests, "warm requests must be within 0..requests"),
            (self.prefixes > 0 or self.warm_requests == 0, "reuse requests need at least one prefix"),
            (self.warm_requests == 0 or self.warm_requests >= self.prefixes,
             "each prefix needs at least one request"),
            (self.chunk_tokens % self.block_size == 0, "chunk_tokens must be a multiple of block_size"),
            (0 <= self.suffix_tokens < self.input_tokens, "suffix_tokens must be below input_tokens"),
            (self.input_tokens >= self.chunk_tokens, "a prompt must hold at least one chunk"),
            (self.output_tokens >= 1, "at least one output token"),
            (self.hbm_tokens >= 0 and self.hbm_tokens % self.chunk_tokens == 0,
             "hbm_tokens must be a multiple of chunk_tokens"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return m.layers * 2 * m.kv_heads * m.head_dim * 2  # BF16

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.block_size


FULL = Recipe()
#: CPU/CI scale: same structure, a tiny random Qwen3, a few hundred tokens, 16 requests, ~1 minute.
QUICK = Recipe(requests=16, concurrency=2, input_tokens=384, output_tokens=16, warm_requests=12, prefixes=3,
               chunk_tokens=64, block_size=16, hbm_tokens=384, dram_bytes=3 << 20, ssd_bytes=16 << 20,
               dram_only_bytes=24 << 20, model=QWEN3_TINY)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    #: Shared prefix id, or None for a cold request.
    prefix: int | None
    #: True for the first request of its prefix (it computes and saves it).
    first: bool
    tokens: np.ndarray = field(repr=False)


def build_cohort(recipe: Recipe) -> list[RequestSpec]:
    """The requests, in arrival order: ``warm_requests`` spread over the prefixes (as evenly as possible),
    the rest cold, shuffled with ``seed``. Token ids are random (the model is random too)."""
    rng = np.random.default_rng(recipe.seed)
    vocab = recipe.model.vocab
    prefix_len = recipe.input_tokens - recipe.suffix_tokens
    prefixes = [rng.integers(0, vocab, prefix_len, dtype=np.int64) for _ in range(recipe.prefixes)]
    kinds: list[int | None] = [i % recipe.prefixes for i in range(recipe.warm_requests)]
    kinds += [None] * (recipe.requests - recipe.warm_requests)
    order = rng.permutation(len(kinds))
    seen: set[int] = set()
    out = []
    for i, j in enumerate(order):
        p = kinds[int(j)]
        if p is None:
            toks = rng.integers(0, vocab, recipe.input_tokens, dtype=np.int64)
        else:
            toks = np.concatenate([prefixes[p], rng.integers(0, vocab, recipe.suffix_tokens, dtype=np.int64)])
        out.append(RequestSpec(i, p, p is not None and p not in seen, toks))
        if p is not None:
            seen.add(p)
    return out


# ---------------------------------------------------------------------------------------------- model


def _torch():
    import torch

    return torch


def build_model(shape: ModelShape, device: str, seed: int) -> Any:
    """A randomly initialised Qwen3-shaped causal LM on ``device`` (initialised there: an 8B model
    initialised on the host would take minutes). BF16 on a GPU; float32 on the CPU, where BF16 matmuls
    are emulated and several times slower (the KV pages are BF16 either way)."""
    torch = _torch()
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=40960,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if device == "cpu" else torch.bfloat16,
                                                 attn_implementation="sdpa")
    return model.eval()


class _Forward:
    """Calls the model with a cache across transformers versions (``cache=`` replaced ``past_key_values=``);
    answers the log-probabilities at the last position."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.kw: dict[str, Any] = {}
        if "logits_to_keep" in params:  # engines compute the last position's logits only
            self.kw["logits_to_keep"] = 1
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def __call__(self, ids: Any, cache: Any) -> Any:
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache}, **self.kw)
        return out.logits[0, -1].float().log_softmax(-1)


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


# ---------------------------------------------------------------------------------------------- engine


class StepLock:
    """A ticket lock: holders are served strictly in the order they called :meth:`acquire`.
    ``threading.Lock`` is not fair (a thread that releases and re-acquires it usually gets it back at once),
    so a decoding request would hold the GPU for all its steps while others wait."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._issued = 0
        self._serving = 0

    @property
    def waiting(self) -> int:
        """Threads queued behind the holder."""
        with self._cond:
            return max(self._issued - self._serving - 1, 0)

    def acquire(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> StepLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class RequestRecord:
    index: int
    prefix: int | None
    first: bool
    input_tokens: int
    hbm_tokens: int = 0
    dram_tokens: int = 0
    lower_tokens: int = 0
    computed_tokens: int = 0
    #: Chunks written into pages by a Manager restore (the last one may be used short of one token).
    manager_chunks: int = 0
    restore_misses: int = 0
    lookup_s: float = 0.0
    restore_s: float = 0.0
    gather_s: float = 0.0
    #: Waits for the step lock: before the prefill (part of TTFT), and over all decode steps.
    queue_s: float = 0.0
    decode_queue_s: float = 0.0
    #: Forward passes, each from taking the step lock until its token is on the host.
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    save_s: float = 0.0
    latency_s: float = 0.0
    saved_chunks: int = 0
    tokens: list[int] = field(default_factory=list)
    #: Log-probabilities of every vocabulary entry at the first output token (for lossy comparisons).
    first_logprobs: Any = field(default=None, repr=False)
    #: Log-probability of each generated token.
    token_logprobs: list[float] = field(default_factory=list)

    @property
    def manager_tokens(self) -> int:
        return self.dram_tokens + self.lower_tokens


class _Entry:
    __slots__ = ("blocks", "pins")

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.pins = 0


class Engine:
    """A paged engine around ``model`` (see the module docstring). Thread-safe: one request per thread."""

    def __init__(self, model: Any, recipe: Recipe, pages: list[Any], *, client: Any = None,
                 engine_id: str = "", salt: bytes = b"") -> None:
        self.model = model
        self.forward = _Forward(model)
        self.recipe = recipe
        self.pages = pages
        self.client = client
        self.engine_id = engine_id
        self.salt = salt
        self.num_blocks = int(pages[0].shape[0])
        self.hbm_chunks = recipe.hbm_tokens // recipe.chunk_tokens
        self._lock = threading.Lock()
        self._steps = StepLock()
        self._cache: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._free = list(range(self.num_blocks))
        self.cuda = pages[0].is_cuda

    @staticmethod
    def blocks_needed(recipe: Recipe) -> int:
        per_request = recipe.input_tokens // recipe.chunk_tokens * recipe.chunk_blocks
        return recipe.hbm_tokens // recipe.block_size + recipe.concurrency * per_request

    # -- HBM prefix cache --------------------------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        """``n`` free blocks, evicting unpinned LRU entries as needed (under the lock)."""
        while len(self._free) < n:
            victim = next((k for k, e in self._cache.items() if e.pins == 0), None)
            if victim is None:
                raise RuntimeError("page pool exhausted: every cached chunk is pinned")
            self._free.extend(self._cache.pop(victim).blocks)
        out, self._free = self._free[:n], self._free[n:]
        return out

    def _trim(self) -> None:
        over = len(self._cache) - self.hbm_chunks
        for k in [k for k, e in self._cache.items() if e.pins == 0][:max(over, 0)]:
            self._free.extend(self._cache.pop(k).blocks)

    # -- pages <-> model cache ---------------------------------------------------------------------------

    def _gather(self, blocks: list[int], n_tokens: int) -> Any:
        """A DynamicCache of the first ``n_tokens`` tokens held by ``blocks`` (in token order)."""
        torch = _torch()
        cache = _new_cache(self.model)
        if not blocks:
            return cache
        idx = torch.tensor(blocks, device=self.pages[0].device)
        d = self.recipe.model.head_dim
        for layer, pg in enumerate(self.pages):
            # Selecting along the blocks axis of the [H, blocks, bs, 2D] view lands the tokens of each head
            # in order in one copy; K and V stay views of it, since ``update`` copies them into the cache
            # (a cat) anyway.
            x = pg.permute(1, 0, 2, 3).index_select(1, idx).to(self.model.dtype)  # [H, n, bs, 2D]
            x = x.view(1, x.shape[0], -1, 2 * d)[:, :, :n_tokens]
            cache.update(x[..., :d], x[..., d:], layer)
        return cache

    def _scatter(self, cache: Any, start_token: int, blocks: list[int]) -> None:
        """Write tokens ``start_token ..`` (``len(blocks)`` blocks of them) of ``cache`` into ``blocks``."""
        torch = _torch()
        bs = self.recipe.block_size
        n = len(blocks) * bs
        idx = torch.tensor(blocks, device=self.pages[0].device)
        for layer, pg in enumerate(self.pages):
            lay = cache.layers[layer]
            kv = torch.cat([lay.keys[0, :, start_token:start_token + n], lay.values[0, :, start_token:start_token + n]],
                           dim=-1)  # [H, n, 2D]
            pg.index_copy_(0, idx, kv.reshape(kv.shape[0], len(blocks), bs, kv.shape[-1]).permute(1, 0, 2, 3)
                           .to(pg.dtype))

    # -- a request -------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Wait for the work queued on the current stream, this request's own: a device-wide synchronize
        would also wait for the other workers' kernels (a gather timed as long as the forward running beside
        it)."""
        if self.cuda:
            _torch().cuda.current_stream(self.pages[0].device).synchronize()

    def _step(self, ids: Any, cache: Any) -> tuple[Any, int, float, float, float]:
        """One forward at the step lock: its log-probabilities, its argmax token, the seconds waited for the
        lock, the seconds of the forward and the time it ended. The lock is held until the token is on the
        host (which waits for this stream's forward), so the next forward launches only once this one ran."""
        t0 = time.perf_counter()
        with self._steps:
            t1 = time.perf_counter()
            lp = self.forward(ids, cache)
            tok = int(lp.argmax())
            t2 = time.perf_counter()
        return lp, tok, t1 - t0, t2 - t1, t2

    def serve(self, req: RequestSpec, stream: Any = None) -> RequestRecord:
        """Serve ``req`` with all its GPU work (gather, forwards, scatter) queued on ``stream``, this
        worker's own CUDA stream (None on the CPU); its forwards wait for their turn at the step lock."""
        with _torch().cuda.stream(stream):
            return self._serve(req)

    def _serve(self, req: RequestSpec) -> RequestRecord:
        torch = _torch()
        from orbitkv_fs.connectors.common import prefix_chunk_keys
        from orbitkv_fs.manager import ChunkBlocks

        r = self.recipe
        rec = RequestRecord(req.index, req.prefix, req.first, len(req.tokens))
        cb = r.chunk_blocks
        t0 = time.perf_counter()
        keys = prefix_chunk_keys([int(t) for t in req.tokens], r.chunk_tokens, salt=self.salt)
        with self._lock:
            hbm = 0
            hit_blocks: list[int] = []
            for k in keys:
                e = self._cache.get(k)
                if e is None:
                    break
                e.pins += 1
                self._cache.move_to_end(k)
                hit_blocks += e.blocks
                hbm += 1
            pinned = keys[:hbm]
            own = self._take((len(keys) - hbm) * cb)
        restored = 0
        try:
            if self.client is not None and hbm < len(keys):
                t1 = time.perf_counter()
                look = self.client.lookup(self.engine_id, keys[hbm:])
                rec.lookup_s = time.perf_counter() - t1
                if look.count:
                    t1 = time.perf_counter()
                    chunks = [ChunkBlocks(k, own[i * cb:(i + 1) * cb]) for i, k in enumerate(keys[hbm:hbm + look.count])]
                    # The Manager writes the blocks on its own streams and synchronises them before it
                    # answers: the gather below, queued after the answer, reads them written.
                    res = self.client.restore(self.engine_id, chunks, lease_id=look.lease_id)
                    rec.restore_s = time.perf_counter() - t1
                    while restored < len(res.restored) and res.restored[restored]:
                        restored += 1
                    rec.restore_misses = look.count - restored
                    # lookup answers how many chunks came from DRAM and how many were promoted from the
                    # lower tier, not which; a restore miss is charged to the lower tier's share
                    rec.dram_tokens = min(look.dram, restored) * r.chunk_tokens
                elif look.lease_id:
                    self.client.release(look.lease_id)
            hit_chunks = hbm + restored
            rec.manager_chunks = restored
            hit_blocks += own[:restored * cb]
            hit = min(hit_chunks * r.chunk_tokens, len(req.tokens) - 1)
            rec.hbm_tokens = min(hbm * r.chunk_tokens, hit)
            rec.dram_tokens = min(rec.dram_tokens, hit - rec.hbm_tokens)
            rec.lower_tokens = hit - rec.hbm_tokens - rec.dram_tokens
            rec.computed_tokens = len(req.tokens) - hit
            with torch.inference_mode():
                t1 = time.perf_counter()
                cache = self._gather(hit_blocks, hit)
                # Ends the gather's timing; it is also this request's last read of its pinned blocks, which
                # another worker may evict and rewrite once released below.
                self._drain()
                rec.gather_s = time.perf_counter() - t1
                ids = torch.as_tensor(req.tokens[hit:], device=self.pages[0].device).unsqueeze(0)
                lp, tok, rec.queue_s, rec.prefill_s, now = self._step(ids, cache)
                rec.ttft_s = now - t0  # TTFT ends with the first token on the host
                rec.first_logprobs = lp.cpu()
                rec.tokens.append(tok)
                rec.token_logprobs.append(float(lp[tok]))
                # The prompt's KV must be written to pages before decoding appends to the cache.
                new_chunks = len(keys) - hit_chunks
                new_blocks = own[restored * cb:]
                t1 = time.perf_counter()
                if new_chunks:
                    self._scatter(cache, hit_chunks * r.chunk_tokens, new_blocks)
                    # The Manager reads these pages on its own streams (on a GPU in its own process, beyond
                    # any stream order) and other workers read them once they are HBM cache entries: they
                    # must have landed. Also keeps the scatter's time out of decode_s.
                    self._drain()
                scatter_s = time.perf_counter() - t1
                for _ in range(r.output_tokens - 1):
                    step = torch.tensor([[tok]], device=ids.device)
                    # One lock per step: the other requests' steps queued meanwhile go first.
                    lp, tok, queue_s, forward_s, _ = self._step(step, cache)
                    rec.decode_queue_s += queue_s
                    rec.decode_s += forward_s
                    rec.tokens.append(tok)
                    rec.token_logprobs.append(float(lp[tok]))
            if self.client is not None and new_chunks:
                t1 = time.perf_counter()
                res = self.client.save(self.engine_id, [ChunkBlocks(keys[hit_chunks + i], new_blocks[i * cb:(i + 1) * cb])
                                                        for i in range(new_chunks)])
                rec.saved_chunks = res.chunks_saved
                rec.save_s = time.perf_counter() - t1 + scatter_s
        except BaseException:
            # The blocks go back to the pool, where another worker's stream may write them at once: what
            # this request queued on them must have finished.
            self._drain()
            with self._lock:
                for k in pinned:
                    self._cache[k].pins -= 1
                self._free.extend(own)
            raise
        # Every page access of this request is complete here (its own, drained above; the Manager's save and
        # restore, finished before they answered): other workers may take or read these blocks at once.
        with self._lock:
            for k in pinned:
                self._cache[k].pins -= 1
            for i in range(len(keys) - hbm):
                k, blocks = keys[hbm + i], own[i * cb:(i + 1) * cb]
                if k in self._cache or self.hbm_chunks == 0:
                    self._free.extend(blocks)
                else:
                    self._cache[k] = _Entry(blocks)
            self._trim()
        rec.latency_s = time.perf_counter() - t0
        return rec

    def hbm_pins(self) -> int:
        with self._lock:
            return sum(e.pins for e in self._cache.values())


def request_streams(device: str, n: int) -> list[Any]:
    """One CUDA stream per worker (None each on the CPU). Made once per benchmark and reused by every run:
    no run pays for a stream's first use (its cuBLAS workspace)."""
    if device == "cpu":
        return [None] * n
    torch = _torch()
    return [torch.cuda.Stream(device=device) for _ in range(n)]


def run_requests(engine: Engine, cohort: Sequence[RequestSpec],
                 streams: Sequence[Any]) -> tuple[list[RequestRecord], float]:
    """Serve ``cohort`` with one worker thread per stream of ``streams`` (:func:`request_streams`; arrival
    order, reuse requests gated on their prefix's first request). Answers the records (by index) and the
    wall time."""
    done = {spec.prefix: threading.Event() for spec in cohort if spec.first}
    queue = collections.deque(cohort)
    qlock = threading.Lock()
    records: dict[int, RequestRecord] = {}
    errors: list[BaseException] = []

    def worker(stream: Any) -> None:
        while not errors:
            with qlock:
                if not queue:
                    return
                spec = queue.popleft()
            try:
                if spec.prefix is not None and not spec.first:
                    done[spec.prefix].wait()
                records[spec.index] = engine.serve(spec, stream)
            except BaseException as e:  # reported once all workers stopped
                errors.append(e)
            finally:
                if spec.first:
                    done[spec.prefix].set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,), name=f"cohort-{i}") for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [records[s.index] for s in cohort], wall


# ---------------------------------------------------------------------------------------------- pages / Manager


class _Pages:
    """The engine's KV pages: torch tensors per layer, host pages file (CPU) or CUDA memory (GPU)."""

    def __init__(self, recipe: Recipe, device: str) -> None:
        torch = _torch()
        m = recipe.model
        self.device = device
        self.num_blocks = Engine.blocks_needed(recipe)
        self.host = None
        shape = (self.num_blocks, m.kv_heads, recipe.block_size, 2 * m.head_dim)
        if device == "cpu":
            from orbitkv_fs.pages import host_engine_pages

            self.host, self.descs = host_engine_pages(num_layers=m.layers, num_blocks=self.num_blocks,
                                                      block_size=recipe.block_size, num_heads=m.kv_heads,
                                                      head_dim=m.head_dim, dtype="bfloat16", layout="vllm_packed")
            self.tensors = [torch.from_numpy(self.host.array(d.name).view(np.int16)).view(torch.bfloat16)
                            for d in self.descs]
        else:
            # one allocation per layer, like an engine's per-layer KV tensors
            self.tensors = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(m.layers)]
            # zeroed on the default stream, which the requests' streams do not wait for
            torch.cuda.synchronize(device)

    def registration(self, recipe: Recipe, codec: str, engine_id: str) -> Any:
        from orbitkv_fs.geometry import EngineRegistration

        m = recipe.model
        if self.host is not None:
            return EngineRegistration(model=f"random-{m.name}", num_layers=m.layers, layer_start=0,
                                      layer_end=m.layers, block_size=recipe.block_size, num_heads=m.kv_heads,
                                      head_dim=m.head_dim, dtype="bfloat16", tensors=self.descs, codec=codec,
                                      engine_id=engine_id, engine_kind="bench")
        from orbitkv_fs.connectors.common import packed_registration

        _torch().cuda.synchronize()
        reg = packed_registration({f"L{i}": t for i, t in enumerate(self.tensors)}, model=f"random-{m.name}",
                                  block_size=recipe.block_size, engine_kind="bench", engine_id=engine_id, codec=codec)
        if reg is None:
            raise RuntimeError("the GPU pages are not CUDA tensors in the packed layout")
        return reg

    def close(self) -> None:
        self.tensors = []
        if self.host is not None:
            self.host.close()


@dataclass
class ManagerSpec:
    codec: str
    dram_bytes: int
    ssd_bytes: int  # 0: no lower tier
    ssd_dir: str
    device: str  # auto | cpu
    shm_dir: str = "/dev/shm"


def _make_manager(spec: ManagerSpec) -> Any:
    from orbitkv_fs.manager import Manager, ManagerConfig

    lower = None
    if spec.ssd_bytes:
        from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

        path = os.path.join(spec.ssd_dir, f"orbitkv-cohort-{os.getpid()}-{time.monotonic_ns()}.log")
        lower = SsdTier(SsdConfig(paths=(path,), capacity=spec.ssd_bytes))
        lower._cohort_path = path  # removed by _close_manager
    return Manager(ManagerConfig(pool_size=spec.dram_bytes, storage_codec=spec.codec, device=spec.device,
                                 shm_dir=spec.shm_dir), lower_tier=lower)


def _close_manager(manager: Any) -> None:
    path = getattr(manager.lower, "_cohort_path", None)
    manager.close()
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _ManagerProcess:
    """The Manager in its own process behind the data plane (needed on a GPU: CUDA IPC handles cannot be
    opened by the process that exported them)."""

    def __init__(self, spec: ManagerSpec) -> None:
        self.endpoint = f"ipc://{tempfile.gettempdir()}/orbitkv-cohort-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.proc = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.tools.bench_cohort", "_manager",
                                      json.dumps(dataclasses.asdict(spec)), self.endpoint],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the Manager process did not start (said {line!r})")
        from orbitkv_fs.dataplane import RemoteClient

        self.client = RemoteClient(self.endpoint)

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve_manager(spec_json: str, endpoint: str) -> int:
    from orbitkv_fs.dataplane import DataPlaneServer

    manager = _make_manager(ManagerSpec(**json.loads(spec_json)))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = DataPlaneServer(manager, endpoint, workers=8)
    gc.freeze()  # as orbitkv-cache-manager does once it serves: full collections skip the start-up heap
    print("ready", flush=True)
    os.dup2(2, 1)  # nobody reads the pipe after "ready": later output must not fill it and block
    try:
        stop.wait()
    finally:
        server.close()
        _close_manager(manager)
    return 0


# ---------------------------------------------------------------------------------------------- one run


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0


#: ManagerStats fields that are gauges (taken at the end); everything else numeric is a counter (a delta).
_GAUGES = frozenset({"engines", "pool_capacity_bytes", "pool_used_bytes", "resident_objects", "resident_bytes",
                     "resident_logical_bytes", "reserved_bytes", "leases_active", "leased_bytes", "workspace_bytes",
                     "inflight_requests"})


def _delta(end: Any, base: Any, key: str = "") -> Any:
    """Counters of ``end`` minus those of ``base`` (nested dicts); gauges and non-numbers as in ``end``."""
    if key in _GAUGES:
        return end
    if isinstance(end, dict):
        base = base if isinstance(base, dict) else {}
        return {k: _delta(v, base.get(k), k) for k, v in end.items()}
    if isinstance(end, (int, float)) and not isinstance(end, bool) and isinstance(base, (int, float)):
        return end - base
    return end


def _warm_manager(client: Any, engine_id: str, pages: "_Pages", recipe: Recipe) -> dict[str, Any]:
    """One save + restore of a throwaway chunk of random KV, then its invalidation: compiles the codec
    kernels (numba on the host, CuPy on a GPU) and warms the tiers before anything is timed. Answers the
    Manager's stats afterwards, the base the run's counters are measured from."""
    import msgspec

    from orbitkv_fs.keys import chunk_key
    from orbitkv_fs.manager import ChunkBlocks

    torch = _torch()
    blocks = list(range(recipe.chunk_blocks))
    gen = torch.Generator(device=pages.tensors[0].device).manual_seed(recipe.seed)
    for t in pages.tensors:
        t[:len(blocks)] = (torch.randn(t[:len(blocks)].shape, generator=gen, device=t.device) * 0.5).to(t.dtype)
    if pages.tensors[0].is_cuda:
        torch.cuda.synchronize()
    key = chunk_key(b"orbitkv-cohort-warmup")
    client.save(engine_id, [ChunkBlocks(key, blocks)])
    look = client.lookup(engine_id, [key])
    client.restore(engine_id, [ChunkBlocks(key, blocks)], lease_id=look.lease_id)
    client.invalidate(chunks=[key], engine_id=engine_id)
    return msgspec.to_builtins(client.stats())


def run_cohort(model: Any, recipe: Recipe, cohort: Sequence[RequestSpec], pages: "_Pages", *, codec: str | None,
               variant: str, device: str, manager_mode: str, ssd_dir: str, streams: Sequence[Any],
               shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """One run: ``codec`` None is the no-cache recompute control (the engine's HBM prefix cache is off too,
    so every prompt is computed in full); otherwise a fresh Manager with that codec (``variant`` "ssd":
    ``dram_bytes`` DRAM + ``ssd_bytes`` SSD; "dram": ``dram_only_bytes`` DRAM, no SSD). ``pages`` are
    shared by the runs (their content before a run does not matter: a block is written before it is read)
    and registered afresh with each run's Manager; so are ``streams``, one per worker
    (``recipe.concurrency`` of them, :func:`request_streams`)."""
    import msgspec

    control = codec is None
    # The recompute control computes every prompt in full; the "prefix-cache" control keeps the engine's own
    # prefix cache (no Manager): a cached prefix then reaches the model exactly as a restored one does.
    rcp = dataclasses.replace(recipe, hbm_tokens=0) if control and variant != "prefix-cache" else recipe
    mgr = proc = None
    client = None
    engine_id = f"cohort-{codec or 'control'}-{variant}"
    try:
        if not control:
            spec = ManagerSpec(codec=codec, dram_bytes=recipe.dram_only_bytes if variant == "dram" else recipe.dram_bytes,
                               ssd_bytes=0 if variant == "dram" else recipe.ssd_bytes, ssd_dir=ssd_dir,
                               device="cpu" if device == "cpu" else "auto", shm_dir=shm_dir)
            if manager_mode == "process":
                proc = _ManagerProcess(spec)
                client = proc.client
            else:
                from orbitkv_fs.client import connect

                mgr = _make_manager(spec)
                client = connect(mgr)
            info = client.register(pages.registration(rcp, codec, engine_id))
            engine_id = info.engine_id
            base = _warm_manager(client, engine_id, pages, rcp)
        engine = Engine(model, rcp, pages.tensors, client=client, engine_id=engine_id,
                        salt=f"random-{recipe.model.name}-seed{recipe.seed}".encode())
        records, wall = run_requests(engine, cohort, streams)
        stats = None
        if client is not None:
            client.unregister(engine_id)
            stats = _delta(msgspec.to_builtins(client.stats()), base)
        pins = engine.hbm_pins()
    finally:
        if proc is not None:
            proc.close()
        if mgr is not None:
            _close_manager(mgr)
    return _summarise(recipe, codec, variant, records, wall, stats, pins)


def _summarise(recipe: Recipe, codec: str | None, variant: str, records: list[RequestRecord], wall: float,
               stats: dict | None, pins: int) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records]
    prefix_len = recipe.input_tokens - recipe.suffix_tokens
    full_hit = min(prefix_len // recipe.chunk_tokens * recipe.chunk_tokens, recipe.input_tokens - 1)
    total = sum(r.input_tokens for r in records)
    tiers = {t: sum(getattr(r, f"{t}_tokens") for r in records) for t in ("hbm", "dram", "lower", "computed")}
    forwards = {"one_token_prefill": [r.prefill_s for r in records if r.computed_tokens == 1],
                "full_prefill": [r.prefill_s for r in records if r.computed_tokens == r.input_tokens],
                "decode_step": [r.decode_s / (len(r.tokens) - 1) for r in records if len(r.tokens) > 1]}
    out: dict[str, Any] = {
        "codec": codec or "recompute",
        "variant": "control" if codec is None else variant,
        "requests": len(records),
        "wall_s": wall,
        "requests_per_s": len(records) / wall,
        "ttft_p50_ms": _pct(ttft, 50) * 1e3,
        "ttft_p95_ms": _pct(ttft, 95) * 1e3,
        "prompt_tokens": total,
        "tier_tokens": tiers,
        "hit_rate": {t: tiers[t] / total for t in ("hbm", "dram", "lower")} | {"miss": tiers["computed"] / total},
        "requests_hit": {
            "hbm": sum(1 for r in records if r.hbm_tokens),
            "manager": sum(1 for r in records if r.manager_tokens),
            "dram": sum(1 for r in records if r.dram_tokens),
            "lower": sum(1 for r in records if r.lower_tokens),
            "none": sum(1 for r in records if not r.hbm_tokens and not r.manager_tokens),
        },
        "restore_misses": sum(r.restore_misses for r in records),
        # reuse requests that got less than their whole shared prefix back from some tier
        "reuse_short": sum(1 for r in records if r.prefix is not None and not r.first
                           and r.input_tokens - r.computed_tokens < full_hit),
        "phase_p50_ms": {p: _pct([getattr(r, f"{p}_s") for r in records if r.manager_tokens], 50) * 1e3
                         for p in ("lookup", "restore", "gather", "queue", "prefill")},
        # Forward passes over all the run's requests, step-lock wait excluded: the prefill of a prompt whose
        # every other token came from a cache (``prefill_s`` of the records with ``computed_tokens`` 1), a
        # prefill of a whole prompt, and a decode step; the first should cost about as much as the last.
        "forward_p50_ms": {k: _pct(xs, 50) * 1e3 for k, xs in forwards.items()},
        "forward_requests": {k: len(forwards[k]) for k in ("one_token_prefill", "full_prefill")},
        # The wait for the step lock, over all the run's requests: before the prefill, and per decode step.
        "step_queue_p50_ms": {
            "prefill": _pct([r.queue_s for r in records], 50) * 1e3,
            "decode_step": _pct([r.decode_queue_s / (len(r.tokens) - 1) for r in records if len(r.tokens) > 1],
                                50) * 1e3,
        },
        # lookup + restore per restored chunk: requests with any SSD-promoted chunk, and DRAM-only ones
        "restore_ms_per_chunk_p50": {
            "ssd": _pct([(r.lookup_s + r.restore_s) / r.manager_chunks for r in records
                         if r.lower_tokens and r.manager_chunks], 50) * 1e3,
            "dram": _pct([(r.lookup_s + r.restore_s) / r.manager_chunks for r in records
                          if r.dram_tokens and not r.lower_tokens and r.manager_chunks], 50) * 1e3,
        },
        "save_s_total": sum(r.save_s for r in records),
        "hbm_pins_end": pins,
        "records": [{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "first_logprobs"}
                    for r in records],
    }
    if stats is not None:
        lower = stats.get("lower") or {}
        batches = stats["codec_batches"]
        encoded = sum(n for rep, n in stats["codec_segments"].items() if rep != "raw") if codec != "none" else 0
        out["manager"] = {
            "ssd_read_bytes": int(lower.get("ssd_read_bytes_total", 0)),
            # lower-tier hits that read no disk bytes on demand: segments still in the write queue, and
            # those the readahead lane had read
            "ssd_read_pending_hits": int(lower.get("ssd_read_pending_hits_total", 0)),
            "ssd_prefetch_read_bytes": int(lower.get("ssd_prefetch_read_bytes_total", 0)),
            "ssd_write_bytes": int(lower.get("ssd_write_bytes_total", 0)),
            "ssd_write_dropped": int(lower.get("ssd_write_dropped_total", 0)),
            "ssd_evicted": int(lower.get("ssd_evicted_total", 0)),
            "segment_hits": stats["hits"],
            "segment_misses": stats["misses"],
            "save_logical_bytes": stats["save_logical_bytes"],
            "save_stored_bytes": stats["save_stored_bytes"],
            "compression_ratio": stats["save_logical_bytes"] / max(stats["save_stored_bytes"], 1),
            "restore_logical_bytes": stats["restore_logical_bytes"],
            "restore_stored_bytes": stats["restore_stored_bytes"],
            # the Manager's time in codec batches: on GPU pages exact segments go through them too (gather,
            # CRC32C, copy out), so `none` has some there; on host pages it has none
            "encode_s": stats["encode_seconds"],
            "decode_s": stats["decode_seconds"],
            "codec_batches": batches,
            "segments_per_batch": encoded / batches if batches else 0.0,
            "codec_segments": stats["codec_segments"],
            "raw_segments": stats["raw_segments"],
            # the GPU codec engine's workspace counters (allocations, grows), where the Manager reports them
            "workspace": {k: v for k, v in stats.items() if k != "workspace_bytes" and ("workspace" in k or
                                                                                     k.startswith("gpu"))},
            "workspace_bytes_end": stats["workspace_bytes"],
            "reserved_bytes_end": stats["reserved_bytes"],
            "leases_active_end": stats["leases_active"],
            "inflight_requests_end": stats["inflight_requests"],
            "decode_failures": stats["decode_failures"],
            "dropped_segments": stats["dropped_segments"],
            "evictions": stats["evictions"],
            "demoted": stats["demoted"],
        }
        m = out["manager"]
        out["reservations_zero"] = not any((m["workspace_bytes_end"], m["reserved_bytes_end"], m["leases_active_end"],
                                            m["inflight_requests_end"], pins))
        out["manager_stats"] = stats
    else:
        out["reservations_zero"] = pins == 0
    out["_records"] = records
    return out


def _compare(run: dict[str, Any], control: dict[str, Any]) -> None:
    """Output differences against the recompute control (same requests), and restore vs recompute TTFT on
    the requests this run served from the Manager."""
    agree = total = 0
    max_first = 0.0
    max_tok = 0.0
    for a, b in zip(run["_records"], control["_records"]):
        n = min(len(a.tokens), len(b.tokens))
        same = sum(x == y for x, y in zip(a.tokens[:n], b.tokens[:n]))
        agree += same
        total += n
        max_first = max(max_first, float((a.first_logprobs - b.first_logprobs).abs().max()))
        for i in range(n):  # token logprobs are comparable while both runs generated the same tokens
            if a.tokens[i] != b.tokens[i]:
                break
            max_tok = max(max_tok, abs(a.token_logprobs[i] - b.token_logprobs[i]))
    served = [(a.ttft_s, b.ttft_s) for a, b in zip(run["_records"], control["_records"]) if a.manager_tokens]
    cached = [(a, b) for a, b in zip(run["_records"], control["_records"]) if a.manager_tokens or a.hbm_tokens]
    c_agree = sum(x == y for a, b in cached for x, y in zip(a.tokens, b.tokens))
    c_total = sum(min(len(a.tokens), len(b.tokens)) for a, b in cached)
    run["vs_control"] = {
        "token_agreement": agree / total if total else 1.0,
        # Over the requests whose prompt came in part from a cache (the engine's or the Manager's): the ones
        # a restore can change.
        "cached_requests": len(cached),
        "cached_token_agreement": c_agree / c_total if c_total else None,
        "first_token_max_abs_logprob_diff": max_first,
        "generated_max_abs_logprob_diff": max_tok,
        "requests_identical": sum(a.tokens == b.tokens for a, b in zip(run["_records"], control["_records"])),
        "manager_served_requests": len(served),
        "manager_served_ttft_p50_ms": _pct([s for s, _ in served], 50) * 1e3,
        "same_requests_recompute_ttft_p50_ms": _pct([c for _, c in served], 50) * 1e3,
        "manager_served_speedup_p50": (_pct([c for _, c in served], 50) / _pct([s for s, _ in served], 50))
        if served else None,
    }


# ---------------------------------------------------------------------------------------------- SmolLM2 ratios


def load_saved_kv(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-layer ``(K, V)`` as BF16 ``[tokens, kv_heads, head_dim]`` from the .npz ``orbitkv-bench codecs
    --save-kv`` writes: the GPU machine has no SmolLM2 package, the sample travels instead."""
    import ml_dtypes

    with np.load(path) as z:
        k, v = (z[n].view(ml_dtypes.bfloat16) for n in ("k", "v"))
    return [(np.ascontiguousarray(k[i]), np.ascontiguousarray(v[i])) for i in range(k.shape[0])]


def smollm2_ratios(codecs: Sequence[str], chunk_tokens: int, max_tokens: int = 512,
                   kv_path: str | None = None) -> dict[str, Any]:
    """Compression ratio and reconstruction error of each codec on the real SmolLM2-135M's KV (the fixed
    sample text, or the saved KV at ``kv_path``), in segments of ``chunk_tokens`` per (layer, K/V), with the
    Manager's layer policy (TurboQuant keeps the first and last two layers exact)."""
    from orbitkv_fs.codecs import decode_segment, encode_segment
    from orbitkv_fs.segment import parse_header

    try:
        if kv_path is not None:
            kv = load_saved_kv(kv_path)
        else:
            from orbitkv_fs.tools.models import SAMPLE_TEXT, prefill_kv

            kv = prefill_kv(SAMPLE_TEXT * 4, max_tokens=max_tokens)
    except Exception as e:  # ModelUnavailable, no tools.models, a bad file: reported, not fatal
        return {"skipped": f"{type(e).__name__}: {e}"}
    layers = len(kv)
    tokens = kv[0][0].shape[0] // chunk_tokens * chunk_tokens
    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", "layers": layers,
                           "tokens": tokens, "kv_heads": int(kv[0][0].shape[1]), "head_dim": int(kv[0][0].shape[2]),
                           "segment_tokens": chunk_tokens, "codecs": {}}
    for codec in codecs:
        try:
            logical = stored = 0
            err_num = err_den = 0.0
            reps: collections.Counter[str] = collections.Counter()
            for layer, pair in enumerate(kv):
                exact = codec.startswith("turboquant") and (layer < 2 or layer >= layers - 2)
                for role, x in zip(("key", "value"), pair):
                    for s in range(0, tokens, chunk_tokens):
                        seg = np.ascontiguousarray(x[s:s + chunk_tokens])
                        blob = encode_segment(seg, "none" if exact else codec, role=role, layer=layer)
                        h = parse_header(blob)
                        reps[h.format.name.lower()] += 1
                        logical += seg.nbytes
                        stored += len(blob)
                        y = decode_segment(blob).astype(np.float32)
                        ref = seg.astype(np.float32).reshape(-1)
                        err_num += float(((y - ref) ** 2).sum())
                        err_den += float((ref ** 2).sum())
            out["codecs"][codec] = {"logical_bytes": logical, "stored_bytes": stored,
                                    "ratio": logical / stored, "relative_rmse": (err_num / err_den) ** 0.5,
                                    "segments": dict(reps)}
        except Exception as e:  # ans without a GPU
            out["codecs"][codec] = {"skipped": f"{type(e).__name__}: {e}"}
    return out


# ---------------------------------------------------------------------------------------------- benchmark


def _ans_skip_reason(device: str) -> str | None:
    if device == "cpu":
        return "ans is GPU-only (nvCOMP); this run is on the CPU"
    try:
        from orbitkv_fs.codecs import get_codec

        get_codec("ans")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("orbitkv-fs", "torch", "transformers", "numpy", "numba", "cupy-cuda13x", "kvikio-cu13",
                "nvidia-libnvcomp-cu13", "msgspec", "pyzmq", "matplotlib"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    out.update(code_identity())
    torch = _torch()
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = str(torch.version.cuda)
    out["cpu_count"] = str(os.cpu_count())
    out["torch_threads"] = str(torch.get_num_threads())
    return out


def benchmark(recipe: Recipe, *, codecs: Sequence[str], variants: Sequence[str], device: str,
              manager_mode: str, ssd_dir: str, shm_dir: str = "/dev/shm", smollm2: bool = True,
              smollm2_kv: str | None = None, rounds: int = 1, log=print, checkpoint=None,
              noise_floors: bool = True) -> dict[str, Any]:
    """The control, then every (variant, codec) run on the same cohort; differences and verdicts.
    With ``rounds`` > 1 each variant's codecs run that many times, in reverse order every other round
    (A B, B A, ...): a codec's position in the sequence (a disk the previous run has just filled, a warmer
    machine) then favours each codec equally often, and the verdicts compare codecs within a round.
    ``checkpoint(partial result)`` is called after every run, so a run cut short by a time limit still
    leaves the runs it finished (mergeable with :func:`merge`)."""
    torch = _torch()
    # every codec, whatever --codecs says: cheap, and the merged report needs one table
    sm = smollm2_ratios(CODECS, chunk_tokens=min(recipe.chunk_tokens, 64), kv_path=smollm2_kv) if smollm2 else None
    cohort = build_cohort(recipe)
    model = build_model(recipe.model, device, recipe.seed)
    fwd = _Forward(model)
    streams = request_streams(device, recipe.concurrency)
    if device != "cpu":
        torch.cuda.synchronize(device)  # the weights were initialised on the default stream, which the workers' skip
    # Warm the kernels (cuBLAS handles and per-stream workspaces, oneDNN primitives) outside any run, on every
    # worker's stream.
    with torch.inference_mode():
        for stream in streams if device != "cpu" else streams[:1]:
            with torch.cuda.stream(stream):
                cache = _new_cache(model)
                fwd(torch.as_tensor(cohort[0].tokens, device=device).unsqueeze(0), cache)
                fwd(torch.tensor([[1]], device=device), cache)
    if device != "cpu":
        torch.cuda.synchronize(device)  # the first run must not time the warm-up's tail
    log(f"cohort: {recipe.requests} requests ({recipe.warm_requests} reuse {recipe.prefixes} prefixes), "
        f"{recipe.input_tokens} input tokens, model {recipe.model.name} on {device}")
    # One set of pages for every run: on a GPU, memory exported through CUDA IPC is best not freed and
    # reallocated run after run.
    pages = _Pages(recipe, device)
    skipped: dict[str, str] = {}
    bar = progress(1 + 2 * noise_floors + len(variants) * rounds * len(codecs), "cohort", "run")
    try:
        kw = dict(device=device, manager_mode=manager_mode, ssd_dir=ssd_dir, streams=streams, shm_dir=shm_dir)
        control = run_cohort(model, recipe, cohort, pages, codec=None, variant="control", **kw)
        bar.update()
        log(f"  recompute: ttft p50 {control['ttft_p50_ms']:.1f} ms, {control['requests_per_s']:.2f} req/s")
        runs = [control]
        floors: dict[str, Any] = {}
        if noise_floors:
            # Token agreement means nothing without the engine's own: a recompute against a second recompute
            # (run-to-run nondeterminism), and the engine's own prefix cache against recompute (what serving a
            # prefix from any cache does to the output when the cached KV is exact: another computation order).
            for name, variant_name in (("recompute_vs_recompute", "control"), ("prefix_cache_vs_recompute", "prefix-cache")):
                extra = run_cohort(model, recipe, cohort, pages, codec=None, variant=variant_name, **kw)
                _compare(extra, control)
                floors[name] = {k: extra["vs_control"][k] for k in (
                    "token_agreement", "cached_requests", "cached_token_agreement", "first_token_max_abs_logprob_diff",
                    "generated_max_abs_logprob_diff", "requests_identical")}
                bar.update()
                log(f"  noise floor {name}: token agreement {floors[name]['token_agreement']:.3f}")

        def snapshot() -> dict[str, Any]:
            snap = {"benchmark": "cohort", "recipe": _recipe_dict(recipe), "device": device,
                    "manager_mode": manager_mode, "skipped": dict(skipped), "partial": True, "noise_floors": floors,
                    "runs": [{k: v for k, v in r.items() if k != "_records"} for r in runs]}
            if sm is not None:
                snap["smollm2_kv"] = sm
            return snap

        if checkpoint is not None:
            checkpoint(snapshot())
        for variant in variants:
            for rnd in range(rounds):
                order = list(codecs) if rnd % 2 == 0 else list(reversed(codecs))
                for pos, codec in enumerate(order):
                    if codec == "ans":
                        why = _ans_skip_reason(device)
                        if why:
                            skipped["ans"] = why
                            bar.update()
                            continue
                    run = run_cohort(model, recipe, cohort, pages, codec=codec, variant=variant, **kw)
                    bar.update()
                    _compare(run, control)
                    run.update(round=rnd, order=pos, control_requests_per_s=control["requests_per_s"])
                    runs.append(run)
                    if checkpoint is not None:
                        checkpoint(snapshot())
                    log(f"  {variant}/{codec}{f' (round {rnd + 1})' if rounds > 1 else ''}: ttft p50 "
                        f"{run['ttft_p50_ms']:.1f} ms, {run['requests_per_s']:.2f} req/s, "
                        f"ssd read {run['manager']['ssd_read_bytes'] / 2**20:.1f} MiB, "
                        f"hits dram {run['hit_rate']['dram']:.2f} ssd {run['hit_rate']['lower']:.2f}")
    finally:
        bar.close()
        pages.close()
    for run in runs:
        run.pop("_records")
    result: dict[str, Any] = {
        "benchmark": "cohort",
        "recipe": _recipe_dict(recipe),
        "device": device,
        "manager_mode": manager_mode,
        "skipped": skipped,
        "noise_floors": floors,
        "runs": runs,
    }
    del model
    if sm is not None:
        result["smollm2_kv"] = sm
    result["verdicts"] = verdicts(runs, floors)
    result["across_rounds"] = across_rounds(result["verdicts"])
    return result


def _recipe_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe) | {"kv_bytes_per_token": recipe.kv_bytes_per_token,
                                         # requests that can hit: reuse requests after their prefix's first
                                         "reuse_requests": recipe.warm_requests - recipe.prefixes,
                                         "prefix_logical_bytes": recipe.prefixes * recipe.kv_bytes_per_token
                                         * (recipe.input_tokens - recipe.suffix_tokens)}


def verdicts(runs: list[dict[str, Any]], floors: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per run: does it beat recompute (its own invocation's control) and ``none`` (same variant, same round
    when there are rounds), and the measured reasons where not; ``floors`` are the noise floors of the
    run's invocation (:func:`benchmark`)."""
    control = next(r for r in runs if r["codec"] == "recompute")
    out = []
    for r in runs:
        if r is control:
            continue
        rnd = r.get("round", 0)  # absent from reports made before rounds
        nones = [x for x in runs if x["codec"] == "none" and x["variant"] == r["variant"]]
        none = next((x for x in nones if x.get("round", 0) == rnd), nones[0] if nones else None)
        vs = r["vs_control"]
        m = r["manager"]
        served = vs["manager_served_requests"]
        control_rps = r.get("control_requests_per_s", control["requests_per_s"])
        beats_rc_ttft = served > 0 and vs["manager_served_ttft_p50_ms"] < vs["same_requests_recompute_ttft_p50_ms"]
        beats_rc_tput = r["requests_per_s"] > control_rps
        notes = []
        if served == 0:
            notes.append("no request was served from the Manager (everything recomputed or HBM hits)")
        elif not beats_rc_ttft:
            ph = r["phase_p50_ms"]
            # absent from reports made before it was measured
            queue = f" + wait for the step lock {ph['queue']:.1f}" if "queue" in ph else ""
            note = (f"on the {served} Manager-served requests TTFT p50 is {vs['manager_served_ttft_p50_ms']:.1f} ms "
                    f"against {vs['same_requests_recompute_ttft_p50_ms']:.1f} ms recomputed; their phases (p50): "
                    f"lookup {ph['lookup']:.1f} + restore {ph['restore']:.1f} + gather {ph['gather']:.1f}{queue} + "
                    f"prefill of the uncached tokens {ph['prefill']:.1f} ms")
            fw, fn = r.get("forward_p50_ms"), r.get("forward_requests")
            if fw and fn["one_token_prefill"]:  # absent from reports made before it was measured
                note += (f"; a one-token prefill took {fw['one_token_prefill']:.1f} ms p50 ({fn['one_token_prefill']} "
                         f"requests) against {fw['full_prefill']:.1f} ms for a whole prompt and "
                         f"{fw['decode_step']:.1f} ms per decode step")
            notes.append(note)
        if not beats_rc_tput:
            notes.append(f"throughput {r['requests_per_s']:.2f} req/s vs {control_rps:.2f} recomputing; "
                         f"saves took {r['save_s_total']:.2f} s in total (encode {m['encode_s']:.2f} s)")
        v: dict[str, Any] = {"variant": r["variant"], "codec": r["codec"], "round": rnd,
                             "beats_recompute_ttft": beats_rc_ttft, "beats_recompute_throughput": beats_rc_tput}
        if none is not None and none is not r:
            nm = none["manager"]
            v["beats_none_ttft"] = r["ttft_p50_ms"] < none["ttft_p50_ms"]
            v["beats_none_throughput"] = r["requests_per_s"] > none["requests_per_s"]
            v["throughput_vs_none"] = r["requests_per_s"] / none["requests_per_s"]
            if "order" in r and none.get("round", 0) == rnd and "order" in none:
                v["ran_before_none"] = r["order"] < none["order"]
            saved = nm["ssd_read_bytes"] - m["ssd_read_bytes"]
            mine, theirs = r["restore_ms_per_chunk_p50"]["ssd"], none["restore_ms_per_chunk_p50"]["ssd"]
            v["ssd_restore_speedup_vs_none"] = theirs / mine if mine and theirs else None
            if not (v["beats_none_ttft"] and v["beats_none_throughput"]):
                notes.append(
                    f"vs none: TTFT p50 {r['ttft_p50_ms']:.1f} vs {none['ttft_p50_ms']:.1f} ms, "
                    f"{r['requests_per_s']:.2f} vs {none['requests_per_s']:.2f} req/s; restore p50 "
                    f"{r['phase_p50_ms']['restore']:.1f} vs {none['phase_p50_ms']['restore']:.1f} ms; decode "
                    f"{m['decode_s']:.2f} s and encode {m['encode_s']:.2f} s in total against "
                    f"{saved / 2**20:.1f} MiB less read from SSD; prompt tokens hit in any tier "
                    f"{1 - r['hit_rate']['miss']:.2f} vs {1 - none['hit_rate']['miss']:.2f}")
        if r.get("reuse_short"):
            reuse = sum(1 for x in r["records"] if x["prefix"] is not None and not x["first"])
            notes.append(f"{r['reuse_short']} of {reuse} reuse requests got less than their whole prefix back "
                         f"(restore misses {r['restore_misses']}; the rest were not found by lookup: evicted from "
                         f"DRAM and not yet published by the SSD writeback, or no DRAM room to promote into)")
        if r["codec"] in LOSSY or r["codec"] == "none":
            floor = (floors or {}).get("prefix_cache_vs_recompute")
            ca = vs.get("cached_token_agreement")
            notes.append(f"{'lossy' if r['codec'] in LOSSY else 'exact'}: {vs['token_agreement']:.3f} of generated "
                         f"tokens agree with recompute"
                         + (f" ({ca:.3f} over the {vs['cached_requests']} requests served in part from a cache)"
                            if ca is not None else "")
                         + f", first-token max |dlogprob| {vs['first_token_max_abs_logprob_diff']:.3g}"
                         + (f"; noise floor: the engine's own prefix cache {floor['cached_token_agreement']:.3f} over "
                            f"its {floor['cached_requests']} cached requests" if floor and floor.get("cached_token_agreement")
                            is not None else ""))
        v["why"] = notes
        out.append(v)
    return out


def across_rounds(verdicts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, codec) that ran in more than one round: in how many rounds it beat recompute and
    ``none``, its throughput relative to ``none`` in each, and whether it ran before ``none`` there. A
    claim that holds in some rounds only is not a result: the report says so."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for v in verdicts:
        groups.setdefault((v["variant"], v["codec"]), []).append(v)
    out = []
    for (variant, codec), vs in groups.items():
        if len(vs) < 2:
            continue
        s: dict[str, Any] = {"variant": variant, "codec": codec, "rounds": len(vs),
                             "beats_recompute_ttft": sum(v["beats_recompute_ttft"] for v in vs),
                             "beats_recompute_throughput": sum(v["beats_recompute_throughput"] for v in vs)}
        if codec != "none" and all("beats_none_throughput" in v for v in vs):
            s["beats_none_ttft"] = sum(v["beats_none_ttft"] for v in vs)
            s["beats_none_throughput"] = sum(v["beats_none_throughput"] for v in vs)
            s["throughput_vs_none"] = [v["throughput_vs_none"] for v in vs]
            s["ran_before_none"] = [v.get("ran_before_none") for v in vs]
        out.append(s)
    return out


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several invocations of the same recipe on the same device (e.g. one codec per
    invocation where a command's time is limited). The first invocation's control is the report's; every
    run keeps the output differences and the throughput it measured against its own invocation's control
    (same cohort, same seed), and each invocation's rounds follow the previous one's."""
    first = results[0]
    for r in results[1:]:
        if r["recipe"] != first["recipe"] or r["device"] != first["device"]:
            raise ValueError("merged results must share the recipe and the device")
    out = dict(first)
    runs, offset = [first["runs"][0]], 0
    for r in results:
        control_rps = r["runs"][0]["requests_per_s"]
        mine = [dict(run) for run in r["runs"] if run["codec"] != "recompute"]
        rounds = 1 + max((run.get("round", 0) for run in mine), default=-1)
        for run in mine:
            run["round"] = run.get("round", 0) + offset
            run.setdefault("control_requests_per_s", control_rps)
        offset += rounds
        runs += mine
    out["runs"] = runs
    out["skipped"] = {k: v for r in results for k, v in r["skipped"].items()}
    out["merged_commands"] = [r["command"] for r in results]
    out["elapsed_s"] = sum(r.get("elapsed_s", 0.0) for r in results)
    out["noise_floors_by_invocation"] = [r.get("noise_floors") or {} for r in results]
    out["verdicts"] = verdicts(out["runs"], first.get("noise_floors"))
    out["across_rounds"] = across_rounds(out["verdicts"])
    return out


# ---------------------------------------------------------------------------------------------- report


def _rounds(result: dict[str, Any]) -> bool:
    """The result holds more than one round (its runs are then named with their round)."""
    return any(r.get("round", 0) for r in result["runs"])


def _name(run: dict[str, Any], rounds: bool) -> str:
    """A run's (or verdict's) codec, with its round when the report has several."""
    if not rounds or run["codec"] == "recompute":
        return run["codec"]
    return f"{run['codec']} (round {run.get('round', 0) + 1})"


def _table(result: dict[str, Any]) -> str:
    rows = ["| variant | codec | TTFT p50 ms | TTFT p95 ms | served TTFT p50 ms (recompute) "
            "| restore ms/chunk DRAM / SSD | req/s | SSD MiB read | hit HBM/DRAM/SSD/miss | ratio | encode s "
            "| decode s | batches | seg/batch | reservations 0 | token agree | max abs dlogprob |",
            "|" + "---|" * 17]
    rounds = _rounds(result)
    for r in result["runs"]:
        m = r.get("manager")
        vs = r.get("vs_control")
        h = r["hit_rate"]
        served = (f"{vs['manager_served_ttft_p50_ms']:.1f} ({vs['same_requests_recompute_ttft_p50_ms']:.1f})"
                  if vs and vs["manager_served_requests"] else "-")
        pc = r["restore_ms_per_chunk_p50"]
        rows.append("| " + " | ".join([
            r["variant"], _name(r, rounds), f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p95_ms']:.1f}", served,
            f"{pc['dram']:.2f} / {pc['ssd']:.2f}" if m else "-",
            f"{r['requests_per_s']:.2f}", f"{m['ssd_read_bytes'] / 2**20:.1f}" if m else "-",
            f"{h['hbm']:.2f}/{h['dram']:.2f}/{h['lower']:.2f}/{h['miss']:.2f}",
            f"{m['compression_ratio']:.2f}" if m else "-", f"{m['encode_s']:.3f}" if m else "-",
            f"{m['decode_s']:.3f}" if m else "-", str(m["codec_batches"]) if m else "-",
            f"{m['segments_per_batch']:.1f}" if m else "-", "yes" if r["reservations_zero"] else "NO",
            f"{vs['token_agreement']:.3f}" if vs else "-",
            f"{vs['first_token_max_abs_logprob_diff']:.3g}" if vs else "-"]) + " |")
    return "\n".join(rows)


def _forward_table(result: dict[str, Any]) -> list[str]:
    """The forward passes' p50 per run (runs of reports made before they were measured are left out)."""
    runs = [r for r in result["runs"] if "forward_p50_ms" in r]
    if not runs:
        return []
    rows = ["Forward passes, p50 ms over each run's requests (how many in brackets): the prefill of a prompt whose "
            "other tokens all came from a cache, a prefill of a whole prompt, and a decode step. Forwards run one "
            "at a time in arrival order, like an engine's step loop without batching; each is timed from taking "
            "the step lock until its token is on the host. The queue columns are the wait for the lock before a "
            "request's prefill and before each decode step.", "",
            "| variant | codec | one-token prefill | whole-prompt prefill | decode step | queue before prefill "
            "| queue per decode step |", "|" + "---|" * 7]
    rounds = _rounds(result)
    for r in runs:
        fw, fn = r["forward_p50_ms"], r["forward_requests"]
        one = f"{fw['one_token_prefill']:.1f} ({fn['one_token_prefill']})" if fn["one_token_prefill"] else "-"
        q = r.get("step_queue_p50_ms")  # absent from reports made before the step lock
        queue = f"{q['prefill']:.1f} | {q['decode_step']:.1f}" if q else "- | -"
        rows.append(f"| {r['variant']} | {_name(r, rounds)} | {one} | {fw['full_prefill']:.1f} ({fn['full_prefill']}) | "
                    f"{fw['decode_step']:.1f} | {queue} |")
    return rows + [""]


def _markdown(result: dict[str, Any]) -> str:
    rc = result["recipe"]
    lines = [f"# Cohort benchmark ({result['device']})", "",
             "```", *result.get("merged_commands", []), result["command"], "```", "",
             f"{rc['requests']} requests at concurrency {rc['concurrency']}; {rc['input_tokens']} input tokens, "
             f"{rc['output_tokens']} output; {rc['warm_requests']} reuse {rc['prefixes']} prefixes; model "
             f"{rc['model']['name']} (random weights; BF16 on a GPU, float32 on the CPU; BF16 KV pages, "
             f"{rc['kv_bytes_per_token'] / 1024:.1f} KiB per token); "
             f"HBM prefix cache {rc['hbm_tokens']} tokens; DRAM {rc['dram_bytes'] / 2**20:.0f} MiB + SSD "
             f"{rc['ssd_bytes'] / 2**20:.0f} MiB (variant ssd) or DRAM {rc['dram_only_bytes'] / 2**20:.0f} MiB "
             f"(variant dram). Manager {result['manager_mode']}."
             + (f" Load average (1 min) {la['start']:.1f} at the start, {la['end']:.1f} at the end, on "
                f"{result.get('versions', {}).get('cpu_count')} CPUs." if (la := result.get("load_average_1m")) else ""),
             "",
             _table(result), "",
             "TTFT = lookup + restore + page gather + wait for the step lock + prefill of the rest (or the full "
             "prefill on a miss). "
             "'served TTFT' is the p50 over the requests this run served from the Manager, and in brackets the "
             "recompute control's p50 on the same requests. 'restore ms/chunk' is lookup + restore per restored "
             "chunk (p50), over requests served from DRAM only and over those with SSD-promoted chunks. Hit rates are fractions of prompt tokens. "
             "Token agreement and max |dlogprob| (first output token, whole vocabulary) are against the "
             "recompute control.", ""]
    floors = result.get("noise_floors") or {}
    if floors:
        rr, pc = floors.get("recompute_vs_recompute"), floors.get("prefix_cache_vs_recompute")
        text = "Noise floors, measured in the same run: "
        if rr:
            text += (f"a recompute against a second recompute agrees on {rr['token_agreement']:.3f} of generated "
                     f"tokens (first-token max |dlogprob| {rr['first_token_max_abs_logprob_diff']:.3g}); ")
        if pc:
            ca = pc.get("cached_token_agreement")
            text += (f"the engine's own prefix cache (no Manager; cached KV never leaves the engine) against "
                     f"recompute agrees on {pc['token_agreement']:.3f}"
                     + (f", {ca:.3f} over the {pc['cached_requests']} requests it served from its cache" if ca is not None
                        else "") + f" (first-token max |dlogprob| {pc['first_token_max_abs_logprob_diff']:.3g}). ")
        lines += [text + "An exact codec's agreement at the prefix-cache floor is the computation order "
                  "(a prefill of the rest over cached KV against a whole-prompt prefill), not the restore.", ""]
    lines += _forward_table(result)
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(f"`{k}`: {v}" for k, v in result["skipped"].items()), ""]
    lines += ["## Verdicts", ""]
    rounds = _rounds(result)
    for v in result["verdicts"]:
        parts = [f"recompute: TTFT {'yes' if v['beats_recompute_ttft'] else 'no'}, throughput "
                 f"{'yes' if v['beats_recompute_throughput'] else 'no'}"]
        if "beats_none_ttft" in v:
            parts.append(f"none: TTFT {'yes' if v['beats_none_ttft'] else 'no'}, throughput "
                         f"{'yes' if v['beats_none_throughput'] else 'no'}")
        if v.get("ssd_restore_speedup_vs_none"):
            parts.append(f"restores from SSD {v['ssd_restore_speedup_vs_none']:.2f}x as fast as none per chunk")
        lines.append(f"* **{v['variant']}/{_name(v, rounds)}** beats " + "; ".join(parts) + ".")
        lines += [f"  * {n}" for n in v["why"]]
    if result.get("across_rounds"):
        lines += ["", "## Across rounds", "",
                  "Codecs run in reverse order every other round; a verdict that holds in some rounds only is "
                  "not a result.", ""]
        for a in result["across_rounds"]:
            n = a["rounds"]
            text = (f"* **{a['variant']}/{a['codec']}**, {n} rounds: beats recompute on TTFT in "
                    f"{a['beats_recompute_ttft']}, on throughput in {a['beats_recompute_throughput']}")
            if "beats_none_throughput" in a:
                ratios = ", ".join(f"{x:.2f}x" + ("" if b is None else " (ran first)" if b else " (ran second)")
                                   for x, b in zip(a["throughput_vs_none"], a["ran_before_none"]))
                text += (f"; beats none on TTFT in {a['beats_none_ttft']}, on throughput in "
                         f"{a['beats_none_throughput']} (throughput vs none per round: {ratios})")
            lines.append(text + ".")
    sm = result.get("smollm2_kv")
    if sm:
        lines += ["", "## Compression on real SmolLM2-135M KV", ""]
        if "skipped" in sm:
            lines.append(f"Skipped: {sm['skipped']}")
        else:
            lines += [f"{sm['model']}, {sm['tokens']} tokens, {sm['layers']} layers, {sm['kv_heads']} KV heads, "
                      f"head_dim {sm['head_dim']}, segments of {sm['segment_tokens']} tokens.", "",
                      "| codec | ratio | relative RMSE | segments |", "|---|---|---|---|"]
            for c, d in sm["codecs"].items():
                if "skipped" in d:
                    lines.append(f"| {c} | skipped: {d['skipped']} | | |")
                else:
                    lines.append(f"| {c} | {d['ratio']:.2f} | {d['relative_rmse']:.4f} | "
                                 f"{', '.join(f'{k} {n}' for k, n in d['segments'].items())} |")
    lines += ["", "## Versions", ""] + [f"* {k}: {v}" for k, v in result.get("versions", {}).items()]
    return "\n".join(lines) + "\n"


def _plots(result: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    rounds = _rounds(result)
    labels = [r["codec"] if r["variant"] == "control" else f"{r['variant']}/{_name(r, rounds)}" for r in runs]
    x = np.arange(len(runs))
    files = []

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    ax[0].bar(x - 0.2, [r["ttft_p50_ms"] for r in runs], 0.4, label="p50")
    ax[0].bar(x + 0.2, [r["ttft_p95_ms"] for r in runs], 0.4, label="p95")
    ax[0].set_ylabel("TTFT (ms)")
    ax[0].legend()
    ax[1].bar(x, [r["requests_per_s"] for r in runs], 0.6, color="tab:green")
    ax[1].set_ylabel("requests / s")
    for a in ax:
        a.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
    fig.suptitle(f"cohort ({result['device']}): TTFT and throughput per codec")
    fig.tight_layout()
    files.append(os.path.join(out_dir, "ttft_throughput.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(x, [r["manager"]["ssd_read_bytes"] / 2**20 if "manager" in r else 0 for r in runs], 0.6,
           color="tab:orange")
    ax.set_ylabel("SSD bytes read (MiB)")
    ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
    ax.set_title(f"cohort ({result['device']}): SSD bytes read per codec")
    fig.tight_layout()
    files.append(os.path.join(out_dir, "ssd_bytes_read.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def write_report(result: dict[str, Any], out_dir: str, *, plots: bool = True) -> list[str]:
    """``cohort.json``, ``cohort.md`` and (with ``plots``) the PNGs under ``out_dir``; answers the paths."""
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "cohort.json"), os.path.join(out_dir, "cohort.md")]
    with open(files[0], "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(files[1], "w") as f:
        f.write(_markdown(result))
    if plots:
        files += _plots(result, out_dir)
    return files


# ---------------------------------------------------------------------------------------------- CLI


def _size(text: str) -> int:
    from orbitkv_fs.tiers.ssd import parse_size

    return parse_size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench cohort",
                                description="Serving benchmark under memory pressure: TTFT and throughput per "
                                            "codec against a no-cache recompute control, with a real model.",
                                formatter_class=HelpFormatter)
    recipe = " (default: the recipe's: Qwen3-8B shape, or --quick's)"
    p.add_argument("--quick", action="store_true", help="CPU/CI scale (tiny random Qwen3, 16 requests)")
    p.add_argument("--requests", type=int, help="requests in the cohort" + recipe)
    p.add_argument("--concurrency", type=int, help="requests in flight at once" + recipe)
    p.add_argument("--input-tokens", type=int, help="prompt tokens per request" + recipe)
    p.add_argument("--output-tokens", type=int, help="tokens generated per request" + recipe)
    p.add_argument("--warm-requests", type=int, help="requests reusing a shared prefix" + recipe)
    p.add_argument("--prefixes", type=int, help="distinct shared prefixes" + recipe)
    p.add_argument("--suffix-tokens", type=int, help="unique tokens after the shared prefix" + recipe)
    p.add_argument("--chunk-tokens", type=int, help="tokens per cached chunk" + recipe)
    p.add_argument("--block-size", type=int, help="tokens per engine block" + recipe)
    p.add_argument("--hbm-tokens", type=int, help="engine HBM prefix-cache budget in tokens" + recipe)
    p.add_argument("--dram", type=_size, help="Manager DRAM with SSD (e.g. 1gib)" + recipe)
    p.add_argument("--ssd", type=_size, help="SSD capacity (e.g. 8gib)" + recipe)
    p.add_argument("--dram-only", type=_size, help="DRAM of the DRAM-only variant (e.g. 8gib)" + recipe)
    p.add_argument("--model", choices=sorted(SHAPES), help="model shape (random weights)" + recipe)
    p.add_argument("--seed", type=int, help="seed of the cohort and the weights" + recipe)
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma list of {', '.join(CODECS)}")
    p.add_argument("--variants", default="ssd,dram", help="ssd (DRAM + SSD) and/or dram (DRAM only)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each variant's codecs this many times, in reverse order every other round")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--manager", choices=("auto", "embedded", "process"), default="auto",
                   help="Manager in this process or its own (auto: own process on a GPU, for CUDA IPC)")
    p.add_argument("--ssd-dir", default=None, help="directory of the SSD log file (default: a temp dir)")
    p.add_argument("--shm-dir", default="/dev/shm", help="directory of the Manager's DRAM arena file (a tmpfs)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge cohort.json files of separate invocations (same recipe) into one report under "
                        "--out (default: run a benchmark)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 with --quick)")
    p.add_argument("--no-smollm2", action="store_true", help="skip compression ratios on real SmolLM2 KV")
    p.add_argument("--smollm2-kv", default=None, metavar="NPZ",
                   help="SmolLM2 K/V saved by `orbitkv-bench codecs --save-kv` instead of running the model "
                        "(default: run it)")
    p.add_argument("--no-floors", action="store_true",
                   help="skip the two noise-floor runs (a second recompute; the engine's own prefix cache)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (matplotlib)")
    p.add_argument("--out", default=None, help="result folder (default docs/results/<date>-cohort[-cpu])")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    return p


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    base = QUICK if args.quick else FULL
    over = {k: getattr(args, a) for k, a in (
        ("requests", "requests"), ("concurrency", "concurrency"), ("input_tokens", "input_tokens"),
        ("output_tokens", "output_tokens"), ("warm_requests", "warm_requests"), ("prefixes", "prefixes"),
        ("suffix_tokens", "suffix_tokens"), ("chunk_tokens", "chunk_tokens"), ("block_size", "block_size"),
        ("hbm_tokens", "hbm_tokens"), ("dram_bytes", "dram"), ("ssd_bytes", "ssd"),
        ("dram_only_bytes", "dram_only"), ("seed", "seed")) if getattr(args, a) is not None}
    if args.model:
        over["model"] = SHAPES[args.model]
    return dataclasses.replace(base, **over)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_manager"]:
        return _serve_manager(argv[1], argv[2])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        try:
            result = merge([json.load(open(p)) for p in args.merge])
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"cannot merge: {e}")
        result["command"] = "orbitkv-bench cohort " + " ".join(argv)
        print("wrote " + ", ".join(write_report(result, args.out, plots=not args.no_plots)))
        return 0
    try:
        recipe = recipe_from_args(args)
    except ValueError as e:
        ap.error(str(e))
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [c for c in codecs if c not in CODECS]:
        ap.error(f"unknown codec(s) {bad}; expected {', '.join(CODECS)}")
    if bad := [v for v in variants if v not in ("ssd", "dram")]:
        ap.error(f"unknown variant(s) {bad}; expected ssd, dram")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    torch = _torch()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    threads = args.threads or (1 if args.quick and device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    manager_mode = args.manager if args.manager != "auto" else ("embedded" if device == "cpu" else "process")
    if device != "cpu" and manager_mode == "embedded":
        ap.error("on a GPU the Manager must run in its own process (--manager process): CUDA IPC handles cannot "
                 "be opened by the process that exported them")
    date = datetime.date.today().isoformat()
    out_dir = args.out or os.path.join("docs", "results", f"{date}-cohort{'-cpu' if device == 'cpu' else ''}")
    tmp = None
    ssd_dir = args.ssd_dir
    if ssd_dir is None:
        tmp = ssd_dir = tempfile.mkdtemp(prefix="orbitkv-cohort-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    elif "ssd" in variants:
        # Made (or refused) now: a missing directory used to surface only when the first SSD run's
        # Manager failed to start, after the recompute control had run.
        try:
            os.makedirs(ssd_dir, exist_ok=True)
        except OSError as e:
            ap.error(f"--ssd-dir {ssd_dir}: {e.strerror}")
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    command = "orbitkv-bench cohort " + " ".join(argv)
    versions = _versions()

    def checkpoint(partial: dict[str, Any]) -> None:
        os.makedirs(out_dir, exist_ok=True)
        partial.update(command=command, date=date, elapsed_s=time.perf_counter() - t0, versions=versions)
        path = os.path.join(out_dir, "cohort.partial.json")
        with open(path + ".tmp", "w") as f:  # a kill mid-write must not cost the previous checkpoint
            json.dump(partial, f, indent=1, default=float)
        os.replace(path + ".tmp", path)

    try:
        result = benchmark(recipe, codecs=codecs, variants=variants, device=device, manager_mode=manager_mode,
                           ssd_dir=ssd_dir, shm_dir=args.shm_dir, smollm2=not args.no_smollm2,
                           smollm2_kv=args.smollm2_kv, rounds=args.rounds, log=log, checkpoint=checkpoint,
                           noise_floors=not args.no_floors)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result["command"] = command
    result["date"] = date
    result["elapsed_s"] = time.perf_counter() - t0
    # other jobs on the machine move every figure: the 1-minute load average before and after the run
    result["load_average_1m"] = {"start": load_start[0], "end": os.getloadavg()[0]}
    result["versions"] = versions
    files = write_report(result, out_dir, plots=not args.no_plots)
    with contextlib.suppress(FileNotFoundError):  # superseded by the complete cohort.json
        os.remove(os.path.join(out_dir, "cohort.partial.json"))
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=float)
        print()
    else:
        print(_table(result))
        rounds = _rounds(result)
        for v in result["verdicts"]:
            name = f"{v['variant']}/{_name(v, rounds)}"
            print(f"{name}: " + "; ".join(v["why"]) if v["why"] else f"{name}: wins")
    log("wrote " + ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
