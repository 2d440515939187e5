"""Engine-independent adapter logic: chunk keys, block math and failure handling.

Every adapter (transformers, vLLM, SGLang) reduces its engine's view of a prompt to a list of 16-byte
chunk keys (:func:`orbitkv_fs.keys.chunk_key`), one per full block of tokens, and to block ids in its
own paged KV memory. This module owns that reduction and the rules around it; it imports neither an
engine nor torch.

Primitives:

* :func:`prefix_chunk_keys` -- chained keys of full token blocks: key ``i`` identifies the whole prefix
  ``tokens[: (i + 1) * block_size]`` together with a salt (model identity, adapter, LoRA, ...).
* :func:`engine_hash_keys` -- chunk keys of an engine's own (already chained) block hashes.
* :class:`BlockMath` -- full blocks of a token count, the loadable part of a hit (an engine must still
  compute at least one prompt token), slot ranges.
* :func:`leading_run` -- length of the leading run of ``True`` in per-key answers.
* :func:`failed_blocks` -- the engine block ids whose keys missed at restore, and everything after the
  first one (a prefix cache is only valid up to its first hole).
* :class:`ManagerGuard` -- turns Manager failures (typed errors, a dead socket, a timeout) into misses,
  counts them, and stops calling a failing Manager for a cool-down period.

Invariants: keys depend only on token ids, block size and salt (never on process state such as Python's
hash seed), so a new engine process finds what an earlier one saved; a chunk key covers only full
blocks; a failure of the storage tier never fails the engine's request -- it becomes a miss and the
engine recomputes.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import OrbitKVError
from ..keys import chunk_key

log = logging.getLogger(__name__)

T = TypeVar("T")

# Token ids are hashed as little-endian uint32: every tokenizer in use has fewer than 2**32 ids, and a
# fixed width keeps "1, 23" and "12, 3" apart without separators.
_TOKEN = struct.Struct("<I")
KEY_SCHEME_VERSION = b"orbitkv-prefix-v1"


class KeyDerivationError(OrbitKVError):
    """Bad input to key derivation (negative or oversized token id, bad block size)."""


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise KeyDerivationError(f"block_size must be a positive integer, got {block_size!r}")


def prefix_chunk_keys(
    token_ids: Sequence[int], block_size: int, *, salt: bytes = b"", parent: bytes | None = None
) -> list[bytes]:
    """One 16-byte key per full block of ``token_ids``; key ``i`` covers the prefix up to block ``i``.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``); ``salt`` separates
    models, adapters and anything else that makes the same tokens produce different KV.
    """
    _check_block_size(block_size)
    n_full = len(token_ids) // block_size
    prev = parent if parent is not None else chunk_key(KEY_SCHEME_VERSION + b"\0" + salt)
    keys: list[bytes] = []
    for b in range(n_full):
        block = token_ids[b * block_size : (b + 1) * block_size]
        try:
            packed = b"".join(_TOKEN.pack(int(t)) for t in block)
        except struct.error as e:
            raise KeyDerivationError(f"token id outside 0..2**32-1 in block {b}: {e}") from None
        prev = chunk_key(prev + packed)
        keys.append(prev)
    return keys


def engine_hash_keys(block_hashes: Iterable["bytes | int | str"], *, salt: bytes = b"") -> list[bytes]:
    """Chunk keys of an engine's own block hashes (vLLM's ``Request.block_hashes``, SGLang page hashes).

    Those hashes already chain the prefix; the salt keeps two models' identical hashes apart.
    """
    out = []
    for h in block_hashes:
        if isinstance(h, int):
            h = h.to_bytes((max(h.bit_length(), 1) + 8) // 8, "little", signed=True)
        elif isinstance(h, str):
            h = h.encode()
        out.append(chunk_key(salt + b"\0" + bytes(h)))
    return out


@dataclass(frozen=True)
class BlockMath:
    """Token/block arithmetic of one engine's block size."""

    block_size: int

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)

    def full_blocks(self, n_tokens: int) -> int:
        return max(n_tokens, 0) // self.block_size

    def loadable_blocks(self, n_prompt_tokens: int, hit_blocks: int) -> int:
        """Blocks of a ``hit_blocks`` hit an engine may load: it must still compute >= 1 prompt token."""
        return max(0, min(hit_blocks, (n_prompt_tokens - 1) // self.block_size))

    def new_matched_tokens(self, n_prompt_tokens: int, hit_blocks: int, n_computed_tokens: int) -> int:
        """Tokens to load beyond what the engine already has (vLLM's ``get_num_new_matched_tokens``)."""
        loadable = self.loadable_blocks(n_prompt_tokens, hit_blocks) * self.block_size
        return max(0, loadable - n_computed_tokens)

    def block_of(self, token_index: int) -> int:
        return token_index // self.block_size

    def slots(self, block_id: int) -> range:
        """Flat slot indices of one block in a ``[num_blocks * block_size]`` slot space."""
        return range(block_id * self.block_size, (block_id + 1) * self.block_size)


def leading_run(flags: Iterable[bool]) -> int:
    """Length of the leading run of true values."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def failed_blocks(keys: Sequence[bytes], block_ids: Sequence[int], missed: Iterable[bytes]) -> list[int]:
    """Engine block ids to recompute after a restore of ``keys`` into ``block_ids`` missed ``missed``.

    A prefix is usable only up to its first hole, so the first missed block and every later block of
    the same request are reported, in order.
    """
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
    missed = set(missed)
    for i, k in enumerate(keys):
        if k in missed:
            return list(block_ids[i:])
    return []


@dataclass
class GuardStats:
    calls: int = 0
    failures: int = 0
    skipped: int = 0
    last_error: str = ""


@dataclass
class ManagerGuard:
    """Runs Manager calls so that their failure is a miss, never an engine error.

    After a failure, calls are skipped (answered with the fallback) for ``cooldown_s`` seconds, so an
    engine does not stall on every block while its Manager is down. Programming errors (TypeError,
    AttributeError, ...) are not caught: they are bugs, not outages.
    """

    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    stats: GuardStats = field(default_factory=GuardStats)
    _open_until: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    CAUGHT = (OrbitKVError, OSError, TimeoutError, ConnectionError)

    @property
    def healthy(self) -> bool:
        return self.clock() >= self._open_until

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        with self._lock:
            if not self.healthy:
                self.stats.skipped += 1
                return fallback
            self.stats.calls += 1
        try:
            return fn()
        except self.CAUGHT as e:
            with self._lock:
                self.stats.failures += 1
                self.stats.last_error = f"{what}: {type(e).__name__}: {e}"
                first = self.healthy
                self._open_until = self.clock() + self.cooldown_s
            if first:
                log.warning("OrbitKV-FS %s failed (%s); treating as a miss for %.1fs", what, e, self.cooldown_s)
            return fallback
