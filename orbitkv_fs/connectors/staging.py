"""Engine KV the Manager cannot import: K/V views of engine tensors and a bounded, pipelined staging area.

Most engines keep KV where the Manager can read and write it in place (CUDA IPC handles, shared-memory
pages files). The rest -- vLLM's CPU backend (every layer's KV one anonymous ``torch.zeros`` buffer), a GPU
whose allocations CUDA IPC cannot share (torch expandable segments, IPC unavailable) -- go through a
staging area: a :class:`~orbitkv_fs.connectors.common.StagingPages` file the adapter registers like any
host pages, and engine-side copies between the engine's blocks and its slots. This module owns both the
K/V geometry of engine tensors and those copies.

Primitives:

* :class:`KVSplit` and :func:`vllm_backend_split` -- where K and V sit in one layer's paged tensor, per
  vLLM attention backend: ``content`` (vLLM's logical ``[blocks, heads, block_size, 2 * head_dim]`` view,
  ``K = x[..., :D]``, what the GPU backends read: FlashAttention, FlashInfer, Triton, FlexAttention, in every
  physical stride order, the cross-layer ``BLHNC`` allocation included) and ``token`` (vLLM's ``CPU_ATTN``
  views a block ``[heads, 2 * block_size, head_dim]`` and splits on the token axis: ``K = x.view(B, H, 2T,
  D)[:, :, :T]``).
* :func:`key_value_views` -- ``(K, V)`` torch views ``[blocks, heads, block_size, head_dim]`` of a tensor.
* :func:`staging_slots` -- slots of a staging area within a byte budget (at least two chunks).
* :class:`StagedSession` -- an :class:`~orbitkv_fs.connectors.common.EngineSession` look-alike (``lookup``,
  ``save``, ``restore`` taking ENGINE block ids) that moves blocks through the staging area in rounds: the
  area is split in two halves, and while the Manager encodes (save) or decodes (restore) one round in one
  half, the engine gathers the next round into (or scatters the previous round out of) the other. Host
  KV is copied with numpy (single-threaded, off the GIL), GPU KV with torch.

Invariants: a staged save or restore never touches an engine block it was not given (``SKIP_BLOCK``
positions are neither read nor written); a half is reused only after the Manager's call on it returned and
its copies ended; a restore stops at its first missed chunk and reports it and every later chunk missed
(what cannot be used as a prefix is not copied into the engine); one staged call runs at a time.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .common import EngineSession, StagingPages

log = logging.getLogger(__name__)

#: Default staging budget (``orbitkv.staging_mib``): 64 MiB, raised to two chunks when one chunk is larger.
DEFAULT_STAGING_BYTES = 64 << 20


class KVSplit(str, enum.Enum):
    """Where K and V sit inside one layer's ``[blocks, heads, block_size, 2 * head_dim]`` paged tensor."""

    CONTENT = "content"  # K = x[..., :D], V = x[..., D:]
    TOKEN = "token"  # x.view(B, H, 2T, D): K = [:, :, :T], V = [:, :, T:]


# vLLM 0.32 to 0.34 attention backends (``AttentionBackend.get_name()``) whose K/V split was read in their
# source: the GPU ones split the content axis (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``),
# CPU_ATTN the token axis (``kv_cache.view(B, H, 2 * T, -1).chunk(2, dim=2)``). Any other backend (MLA,
# recurrent state, NVFP4 head groups, backends not checked) leaves the connector off rather than guess.
_VLLM_SPLITS = {
    "FLASH_ATTN": KVSplit.CONTENT,
    "FLASHINFER": KVSplit.CONTENT,
    "TRITON_ATTN": KVSplit.CONTENT,
    "FLEX_ATTENTION": KVSplit.CONTENT,
    "CPU_ATTN": KVSplit.TOKEN,
}


def vllm_backend_split(backend_name: str | None) -> KVSplit | None:
    """The K/V split of a vLLM attention backend, None for a backend this adapter does not know."""
    return _VLLM_SPLITS.get(str(backend_name or "").upper())


def key_value_views(t: Any, split: KVSplit) -> tuple[Any, Any]:
    """``(K, V)`` views ``[blocks, heads, block_size, head_dim]`` of a ``[blocks, heads, block_size,
    2 * head_dim]`` torch tensor (any strides for ``content``; ``token`` needs each block-head's
    ``[block_size, 2 * head_dim]`` contiguous, as vLLM's CPU backend allocates it)."""
    b, h, t_, d2 = (int(x) for x in t.shape)
    d = d2 // 2
    if split == KVSplit.CONTENT:
        return t[..., :d], t[..., d:]
    if t.stride(3) != 1 or t.stride(2) != d2:
        raise ValueError(f"token-split KV needs contiguous [block_size, 2*head_dim] rows, strides {t.stride()}")
    v = t.view(b, h, 2 * t_, d)
    return v[:, :, :t_], v[:, :, t_:]


def staging_slots(budget_bytes: int, block_bytes: int, chunk_blocks: int) -> int:
    """Slots (engine blocks) of a staging area of about ``budget_bytes`` when one block of every layer is
    ``block_bytes``: a whole number of chunks per half, at least one chunk per half."""
    per_half = max(1, budget_bytes // max(block_bytes, 1) // 2 // chunk_blocks)
    return 2 * per_half * chunk_blocks


def _torch_copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` across devices (a GPU engine's blocks and host staging slots)."""
    dst.copy_(src)


class StagedSession:
    """An engine's KV moved through a staging area (see the module docstring).

    ``engine_kv`` maps a global layer index to that layer's ``(K, V)`` views ``[blocks, heads, block_size,
    head_dim]`` of engine memory (:func:`key_value_views`; any device). ``session`` is registered for
    ``staging``; ``chunk_blocks`` engine blocks make one chunk (one key).
    """

    def __init__(self, session: EngineSession, staging: StagingPages, engine_kv: dict[int, tuple[Any, Any]],
                 *, chunk_blocks: int, torch_dtype: Any) -> None:
        from .hf import _as_torch

        if staging.slots < 2 * chunk_blocks or staging.slots % (2 * chunk_blocks):
            raise ValueError(f"{staging.slots} staging slots do not hold two halves of whole {chunk_blocks}-block chunks")
        self.session = session
        self.staging = staging
        self.chunk_blocks = chunk_blocks
        self._half = staging.slots // 2
        self._round = self._half // chunk_blocks  # chunks per round
        if all(not k.is_cuda and not v.is_cuda for k, v in engine_kv.values()):
            # Host KV: copy with numpy, as same-width integers (no dtype conversion, bf16 included). numpy's
            # copies are single-threaded and release the GIL; torch's run on its intra-op pool, which the
            # engine's forward uses too (oversubscribed, its barriers made a 45 MiB round trip 20-40x
            # slower on this 2-core machine: docs/results/2026-12-01-vllm-staging).
            import torch

            np_int, tint = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}[staging.key(
                next(iter(engine_kv))).dtype.itemsize]
            self._kv = {layer: (k.view(tint).numpy(), v.view(tint).numpy()) for layer, (k, v) in engine_kv.items()}
            self._stage = {layer: (staging.key(layer).view(np_int), staging.value(layer).view(np_int))
                           for layer in engine_kv}
            self._copy = np.copyto
        else:
            self._kv = engine_kv
            self._stage = {layer: (_as_torch(staging.key(layer), torch_dtype), _as_torch(staging.value(layer), torch_dtype))
                           for layer in engine_kv}
            self._copy = _torch_copy
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-staging")
        self._lock = threading.Lock()
        #: Seconds the caller spent copying (gather + scatter) and waiting on the Manager, for benchmarks.
        self.copy_seconds = 0.0
        self.wait_seconds = 0.0

    @property
    def engine_id(self) -> str:
        return self.session.engine_id

    @property
    def guard(self) -> Any:
        return self.session.guard

    def lookup(self, keys: Sequence[bytes], *, if_unknown: int | None = None) -> int:
        return self.session.lookup(keys, if_unknown=if_unknown)

    # -- copies -------------------------------------------------------------------------------------

    def _pairs(self, blocks: Sequence[Sequence[int]], half: int) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
        """Runs ``(engine block, slot, length)`` of consecutive engine blocks going to consecutive slots
        (``SKIP_BLOCK`` positions left out), and the slot lists the Manager gets (``SKIP_BLOCK`` kept, so it
        neither reads nor writes those positions)."""
        from ..manager import SKIP_BLOCK

        runs: list[tuple[int, int, int]] = []
        slots = []
        base = half * self._half
        for c, chunk in enumerate(blocks):
            row = []
            for p, b in enumerate(chunk):
                s = base + c * self.chunk_blocks + p
                if b == SKIP_BLOCK:
                    row.append(SKIP_BLOCK)
                    continue
                row.append(s)
                b = int(b)
                if runs and runs[-1][0] + runs[-1][2] == b and runs[-1][1] + runs[-1][2] == s:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((b, s, 1))
            slots.append(row)
        return runs, slots

    # One slice copy per run of consecutive blocks: indexed copies (index_put_) of these strided views run
    # several times slower than copy_ of slices.
    def _move(self, runs: Sequence[tuple[int, int, int]], layers: Sequence[int], *, to_stage: bool) -> None:
        """Copy each run's blocks engine -> slots (``to_stage``, a save's gather) or back (a restore's scatter)."""
        copy = self._copy
        for layer in layers:
            (ek, ev), (sk, sv) = self._kv[layer], self._stage[layer]
            for b, s, n in runs:
                for eng, stage in ((ek, sk), (ev, sv)):
                    if to_stage:
                        copy(stage[s:s + n], eng[b:b + n])
                    else:
                        copy(eng[b:b + n], stage[s:s + n])

    def _timed(self, fut: Future) -> Any:
        import time

        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.wait_seconds += time.perf_counter() - t0

    # -- save / restore -----------------------------------------------------------------------------

    def save(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]]) -> object | None:
        """Save each key's engine blocks; the last round's SaveResult, None when a round could not reach
        the Manager (later rounds are not sent)."""
        import time

        if not keys:
            return None
        r = self._round
        layers = sorted(self._kv)
        with self._lock:
            pending: Future | None = None
            result: object | None = None
            for i, first in enumerate(range(0, len(keys), r)):
                half = i % 2
                runs, slots = self._pairs(blocks[first:first + r], half)
                t0 = time.perf_counter()
                self._move(runs, layers, to_stage=True)  # the other half may be in the Manager's hands meanwhile
                self.copy_seconds += time.perf_counter() - t0
                if pending is not None:
                    result = self._timed(pending)
                    if result is None:
                        return None
                part = list(keys[first:first + r])
                pending = self._pool.submit(self.session.save, part, slots)
            assert pending is not None
            return self._timed(pending)

    def restore(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]], *,
                layers: Sequence[int] | None = None) -> list[bytes]:
        """Restore each key into its engine blocks (only ``layers`` when given); the keys that missed: the
        first missed chunk and every chunk after it."""
        import time

        if not keys:
            return []
        todo = sorted(self._kv) if layers is None else [int(x) for x in layers]
        r = self._round
        starts = list(range(0, len(keys), r))
        plans = [self._pairs(blocks[s:s + r], i % 2) for i, s in enumerate(starts)]
        with self._lock:
            def submit(i: int) -> Future:
                return self._pool.submit(self.session.restore, list(keys[starts[i]:starts[i] + r]), plans[i][1],
                                         layers=layers)

            pending = submit(0)
            for i, first in enumerate(starts):
                missed = set(self._timed(pending))
                part = keys[first:first + r]
                ok = next((j for j, k in enumerate(part) if k in missed), len(part))
                if ok == len(part) and i + 1 < len(starts):
                    pending = submit(i + 1)  # into the other half, while this one is copied out
                runs = plans[i][0]
                if ok < len(part):  # copy out only the chunks before the first miss
                    runs = self._pairs(blocks[first:first + ok], i % 2)[0]
                t0 = time.perf_counter()
                self._move(runs, todo, to_stage=False)
                self.copy_seconds += time.perf_counter() - t0
                if ok < len(part):
                    return list(keys[first + ok:])
            return []

    def close(self) -> None:
        """Wait for a round in flight, then stop the Manager thread."""
        self._pool.shutdown(wait=True)
