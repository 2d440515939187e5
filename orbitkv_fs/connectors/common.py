"""Engine-independent adapter logic: chunk keys, block math and failure handling.

Every adapter (transformers, vLLM, SGLang) reduces its engine's view of a prompt to a list of 16-byte
chunk keys (:func:`orbitkv_fs.keys.chunk_key`), one per full block of tokens, and to block ids in its
own paged KV memory. This module owns that reduction and the rules around it; it imports neither an
engine nor torch.

Primitives:

* :func:`prefix_chunk_keys` -- chained keys of full token blocks: key ``i`` identifies the whole prefix
  ``tokens[: (i + 1) * block_size]`` together with a salt (model identity) and the request's
  :class:`KVInputs` (LoRA adapter, ``cache_salt``, multimodal input hashes: what vLLM's block hashes mix in).
* :func:`engine_hash_keys` -- chunk keys of an engine's own (already chained) block hashes.
* :class:`BlockMath` -- full blocks of a token count, the loadable part of a hit (an engine must still
  compute at least one prompt token), slot ranges.
* :func:`leading_run` -- length of the leading run of ``True`` in per-key answers.
* :class:`ManagerGuard` -- turns Manager failures (typed errors, a dead socket, a timeout) into misses,
  counts them, and stops calling a failing Manager for a cool-down period (probed with a short ping,
  backing off while it stays down); :func:`ping_probe` builds that probe.
* :class:`RestRegistrar` -- engine registration over the HTTP control plane (``POST /v1/engines``);
  :func:`registration_calls` picks it or the data-plane client for an adapter.
* :class:`EngineSession` -- one registered engine's lookup/save/restore through the client API, guarded,
  registering again when the Manager no longer knows the engine (restarted).
* :class:`PrefixPlanner` -- scheduler bookkeeping of a paged engine (what to load, what to save), one
  chunk per ``chunk_blocks`` engine blocks: a chunk the engine holds in part is loaded with
  :data:`~orbitkv_fs.manager.SKIP_BLOCK` at the positions it holds already.
* :func:`packed_registration` -- registration of per-layer paged torch tensors (global layer indices of
  one pipeline stage) through :func:`tensor_handle`: CUDA IPC, or a shared pages file for CPU tensors.
* :func:`layer_index` -- the global layer number in an engine's layer name (vLLM's rule).
* :class:`LayerLoadJob`, :class:`LayerLoader` -- a step's restores on a loader thread, layer group by
  layer group in order, with per-layer waits and the failed blocks collected at the end.
* :class:`StagingPages` -- host pages (``vllm_packed`` layout, one ``[slots, heads, block, 2 * head_dim]``
  tensor per layer) in a shared-memory file, for engines whose KV is not memory the Manager can import
  (transformers ``DynamicCache``, SGLang's pinned host pool, vLLM's CPU backend and GPUs without CUDA IPC
  through :mod:`.staging`): the adapter copies KV in and out.

Invariants: keys depend only on token ids, block size, salt and :class:`KVInputs` (never on process state
such as Python's hash seed), so a new engine process finds what an earlier one saved; a chunk key covers only full
blocks; a failure of the storage tier never fails the engine's request -- it becomes a miss and the
engine recomputes.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

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


@dataclass(frozen=True)
class MMInput:
    """A multimodal input of a prompt: its content hash and the placeholder tokens it fills."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class KVInputs:
    """What besides the token ids changes a prompt's KV, as vLLM's block hashes mix it in
    (``generate_block_hash_extra_keys``): the LoRA adapter (vLLM: its name and path), the request's
    ``cache_salt`` (per-tenant isolation) and the multimodal inputs (the same placeholder tokens stand for
    different images). Each is part of the chunk keys, so two values never share KV."""

    lora: str | None = None
    cache_salt: str | None = None
    mm: tuple[MMInput, ...] = ()

    def root(self) -> bytes:
        """Bytes mixed into the chain's root: every chunk depends on them (vLLM mixes the LoRA into every
        block and the salt into the first; chaining makes that the same)."""
        out = b""
        for tag, value in ((b"lora", self.lora), (b"cache_salt", self.cache_salt)):
            if value is not None:
                raw = value.encode()
                out += b"\0" + tag + struct.pack("<Q", len(raw)) + raw
        return out

    def chunk_extras(self, start: int, end: int) -> bytes:
        """Bytes mixed into the chunk of tokens ``[start, end)``: every multimodal input it overlaps, with
        its offset relative to the chunk (vLLM's ``("mm", identifier, offset - start)``)."""
        out = b""
        for m in self.mm:
            if m.offset < end and start < m.offset + m.length:
                raw = m.identifier.encode()
                out += b"mm" + struct.pack("<Qq", len(raw), m.offset - start) + raw
        return out


def prefix_chunk_keys(
    token_ids: Sequence[int], block_size: int, *, salt: bytes = b"", parent: bytes | None = None,
    inputs: KVInputs | None = None,
) -> list[bytes]:
    """One 16-byte key per full block of ``token_ids``; key ``i`` covers the prefix up to block ``i``.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``); ``salt`` separates
    models and anything else that makes the same tokens produce different KV; ``inputs`` are the request's
    own such inputs (LoRA, ``cache_salt``, multimodal hashes). Without ``inputs`` (or with empty ones) the
    keys are those of the tokens alone.
    """
    _check_block_size(block_size)
    n_full = len(token_ids) // block_size
    root = inputs.root() if inputs is not None else b""
    prev = parent if parent is not None else chunk_key(KEY_SCHEME_VERSION + b"\0" + salt + root)
    # One vectorised packing of the whole prompt: a scheduler derives the keys of every waiting prompt on
    # every step it cannot schedule it, and long prompts are tens of thousands of tokens.
    try:
        ids = np.asarray(token_ids[: n_full * block_size], dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as e:
        raise KeyDerivationError(f"token ids are not integers in 0..2**32-1: {e}") from None
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF):
        b = int(np.argmax((ids < 0) | (ids > 0xFFFFFFFF))) // block_size
        raise KeyDerivationError(f"token id outside 0..2**32-1 in block {b}")
    packed = ids.astype("<u4").tobytes()
    step = block_size * _TOKEN.size
    mm = inputs.mm if inputs is not None else ()
    keys: list[bytes] = []
    for b in range(n_full):
        # Token bytes have a fixed length per block, so the extras that follow can never alias tokens.
        extra = inputs.chunk_extras(b * block_size, (b + 1) * block_size) if mm else b""  # type: ignore[union-attr]
        prev = chunk_key(prev + packed[b * step : (b + 1) * step] + extra)
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


@dataclass
class GuardStats:
    calls: int = 0
    failures: int = 0
    skipped: int = 0
    probes_failed: int = 0
    last_error: str = ""


@dataclass
class ManagerGuard:
    """Runs Manager calls so that their failure is a miss, never an engine error.

    After a failure, calls are skipped (answered with the fallback) for ``cooldown_s`` seconds, so an
    engine does not stall on every block while its Manager is down. When the cool-down ends, ``probe``
    (a cheap call with a short timeout, e.g. a ping) runs before the next real call: while the Manager
    stays down, each failed probe doubles the cool-down up to ``max_cooldown_s``, so a dead Manager costs
    one short probe per cool-down instead of one full call timeout. The first success resets it.
    Programming errors (TypeError, AttributeError, ...) are not caught: they are bugs, not outages.
    """

    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    probe: Callable[[], object] | None = None
    clock: Callable[[], float] = time.monotonic
    stats: GuardStats = field(default_factory=GuardStats)
    _open_until: float = 0.0
    _down: bool = False
    _probing: bool = False
    _current_cooldown: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    CAUGHT = (OrbitKVError, OSError, TimeoutError, ConnectionError)

    @property
    def healthy(self) -> bool:
        return self.clock() >= self._open_until

    def _trip(self, what: str, e: BaseException, *, probe: bool) -> None:
        with self._lock:
            self.stats.failures += 1
            if probe:
                self.stats.probes_failed += 1
            self.stats.last_error = f"{what}: {type(e).__name__}: {e}"
            first = not self._down
            self._current_cooldown = (self.cooldown_s if first
                                      else min(max(self._current_cooldown, self.cooldown_s) * 2, self.max_cooldown_s))
            self._down = True
            self._open_until = self.clock() + self._current_cooldown
            cooldown = self._current_cooldown
        if first:
            log.warning("OrbitKV-FS %s failed (%s); treating as a miss for %.1fs", what, e, cooldown)

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        with self._lock:
            if not self.healthy or self._probing:
                self.stats.skipped += 1
                return fallback
            probe = self.probe if self._down else None
            self._probing = probe is not None
            self.stats.calls += 1
        if probe is not None:
            try:
                probe()
            except self.CAUGHT as e:
                self._trip(f"{what} (probe)", e, probe=True)
                return fallback
            else:  # the Manager answers: a failing call now starts a fresh cool-down, not a doubled one
                with self._lock:
                    self._current_cooldown = 0.0
                    self._down = False
            finally:
                with self._lock:
                    self._probing = False
        try:
            result = fn()
        except self.CAUGHT as e:
            self._trip(what, e, probe=False)
            return fallback
        if self._down or probe is not None:
            with self._lock:
                recovered = self._down or probe is not None
                self._down, self._current_cooldown = False, 0.0
            if recovered:
                log.warning("OrbitKV-FS %s succeeded again; the Manager is back", what)
        return result


# ------------------------------------------------------------------------------------- REST registration


class RestRegistrar:
    """Registers engines over the Manager's HTTP control plane (``POST /v1/engines``, ``DELETE
    /v1/engines/{id}``), the way DESIGN.md has adapters register; data then flows over the data plane.

    Host-pages handles are sent as shared-memory object names (the file must lie in the Manager's
    ``--shm-dir``), CUDA IPC handles as base64. ``token`` is the Manager's admin token (needed off
    loopback; ``$ORBITKV_ADMIN_TOKEN`` by default). Failures raise :class:`~orbitkv_fs.errors.OrbitKVError`
    with the Manager's error code and message. Standard library only (urllib). :meth:`register` keeps the
    credential every data-plane call for the engine must carry in :attr:`credentials` (hand it to the
    client: ``client.set_credential``; :func:`registration_calls` does).
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        import os

        if "://" not in base_url:
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else os.environ.get("ORBITKV_ADMIN_TOKEN")
        self.timeout_s = timeout_s
        self.credentials: dict[str, str] = {}  # engine id -> the credential its registration answered

    @staticmethod
    def body(reg: object) -> dict:
        """The JSON body of ``POST /v1/engines`` for an :class:`~orbitkv_fs.geometry.EngineRegistration`."""
        import base64
        import os

        import msgspec

        from ..geometry import CudaIpcHandle

        doc = msgspec.to_builtins(reg)
        for desc, out in zip(reg.tensors, doc["tensors"]):  # type: ignore[attr-defined]
            h = desc.handle
            if isinstance(h, CudaIpcHandle):
                out["handle"] = {"type": "cuda_ipc", "handle": base64.b64encode(h.handle).decode(),
                                 "offset": h.offset, "device": h.device, "size": h.size}
            else:
                out["handle"] = {"type": "host", "name": os.path.basename(h.path), "offset": h.offset}
        return doc

    def _request(self, method: str, path: str, doc: dict | None = None) -> dict | None:
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(doc).encode() if doc is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read() or b"{}")
            except ValueError:
                err = {}
            raise OrbitKVError(f"{method} {path}: HTTP {e.code} {err.get('code', '')}: "
                               f"{err.get('message', e.reason)}") from None
        except urllib.error.URLError as e:
            raise OrbitKVError(f"{method} {path}: control plane at {self.base_url} unreachable: {e.reason}") from None
        return json.loads(raw) if raw else None

    def register(self, reg: object) -> str:
        """Register ``reg``; the Manager's engine id (its credential goes to :attr:`credentials`)."""
        out = self._request("POST", "/v1/engines", self.body(reg))
        engine_id = str(out["engine_id"])  # type: ignore[index]
        self.credentials[engine_id] = str(out["credential"])  # type: ignore[index]
        return engine_id

    def unregister(self, engine_id: str) -> None:
        from urllib.parse import quote

        self._request("DELETE", f"/v1/engines/{quote(engine_id, safe='')}")


def registration_calls(client: Any, reg: object, http: str | None, *, timeout_s: float = 30.0,
                       on_info: Callable[[Any], None] | None = None) -> tuple[Callable[[], str], Callable[[str], None]]:
    """``(register, unregister)`` of ``reg``: over the REST control plane at ``http`` when given (the
    credential it answers goes to ``client``), else over ``client`` (which answers the whole EngineInfo:
    ``on_info`` gets it, and keeps the credential itself). ``register()`` answers the engine id and may be
    called again (a restarted Manager)."""
    if http:
        rest = RestRegistrar(http, timeout_s=timeout_s)

        def register_rest() -> str:
            engine_id = rest.register(reg)
            client.set_credential(engine_id, rest.credentials[engine_id])
            return engine_id

        return register_rest, rest.unregister

    def register() -> str:
        info = client.register(reg)
        if on_info is not None:
            on_info(info)
        return info.engine_id

    return register, client.unregister


def register_session(client: Any, reg: object, http: str | None, guard: "ManagerGuard", *, timeout_s: float = 30.0,
                     on_info: Callable[[Any], None] | None = None) -> tuple["EngineSession | None", Callable[[str], None]]:
    """Register ``reg`` (see :func:`registration_calls`) under ``guard``: the engine's session, or None when
    the Manager could not be reached, and the unregister call. The session registers the same pages again
    when a restarted Manager no longer knows the engine."""
    register, unregister = registration_calls(client, reg, http, timeout_s=timeout_s, on_info=on_info)
    engine_id = guard.call("register", register, None)
    session = None if engine_id is None else EngineSession(client, engine_id, guard=guard, reregister=register)
    return session, unregister


# ------------------------------------------------------------------------------------- Manager session


def connect_client(target: object, *, timeout_s: float = 30.0, connect_timeout_s: float = 5.0) -> object:
    """A client of the Manager ``target``: an endpoint string (``tcp://...``, ``ipc://...``) or an
    in-process :class:`~orbitkv_fs.manager.Manager`. A remote Manager is pinged first, waiting at most
    ``connect_timeout_s`` (an engine starting while its Manager is down must not wait a call timeout), and
    every call then waits at most ``timeout_s``: an engine must not stall for long on a Manager that went
    away."""
    if not isinstance(target, str):
        from ..client import connect

        return connect(target)  # type: ignore[arg-type]
    from ..dataplane import RemoteClient

    probe = RemoteClient(target, timeout=min(timeout_s, connect_timeout_s))
    try:
        probe.ping()
    finally:
        probe.close()
    return RemoteClient(target, timeout=timeout_s)


def ping_probe(target: object, *, timeout_s: float = 1.0) -> Callable[[], object] | None:
    """A :attr:`ManagerGuard.probe` for ``target``: a ping over a fresh socket that waits at most
    ``timeout_s`` (a REQ socket to a dead Manager would otherwise wait for the full call timeout).
    None for an in-process Manager, which cannot go away on its own."""
    if not isinstance(target, str):
        return None

    def ping() -> None:
        from ..dataplane import RemoteClient

        client = RemoteClient(target, timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()

    return ping


class EngineSession:
    """One registered engine's view of the client API, with every failure turned into a miss.

    ``client`` is an :mod:`orbitkv_fs.client` client (embedded or remote) or a
    :class:`~orbitkv_fs.manager.Manager`: anything with ``lookup``, ``save`` and ``restore`` taking an
    engine id. A chunk is one key and the engine block ids (token order) that hold it.

    ``reregister`` (the adapter's own registration, returning the new engine id) runs when the Manager
    answers that it does not know the engine -- it restarted, or unregistered it -- and the call is then
    retried once: a Manager restart costs the engine one round trip instead of its cache.
    """

    def __init__(self, client: object, engine_id: str, *, guard: ManagerGuard | None = None,
                 reregister: Callable[[], str] | None = None) -> None:
        self.client = client
        self.engine_id = engine_id
        self.guard = guard or ManagerGuard()
        self._reregister = reregister
        self._rereg_lock = threading.Lock()
        self.reregistrations = 0

    def _call(self, what: str, fn: Callable[[str], T], fallback: T) -> T:
        from ..manager import UnknownEngine

        def run() -> T:
            engine_id = self.engine_id
            try:
                return fn(engine_id)
            except UnknownEngine:
                if self._reregister is None:
                    raise
                with self._rereg_lock:
                    if self.engine_id == engine_id:  # another thread may have re-registered already
                        log.warning("OrbitKV-FS: the Manager does not know engine %s (restarted?); registering "
                                    "again", engine_id)
                        self.engine_id = self._reregister()
                        self.reregistrations += 1
                return fn(self.engine_id)

        return self.guard.call(what, run, fallback)

    def lookup(self, keys: Sequence[bytes], *, if_unknown: int | None = None) -> int:
        """Leading run of ``keys`` the Manager holds in full (0 when it cannot answer). ``if_unknown`` is
        the answer when the Manager does not know the engine (registered with another Manager); None makes
        that a failure like any other."""
        if not keys:
            return 0
        from ..manager import UnknownEngine

        def run(engine_id: str) -> int:
            try:
                return int(self.client.lookup(engine_id, list(keys), lease=False).count)
            except UnknownEngine:
                if if_unknown is None:
                    raise
                return if_unknown

        return self._call("lookup", run, 0)

    def save(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]]) -> object | None:
        """Save each key's blocks; the Manager's SaveResult, or None when it could not be reached."""
        if not keys:
            return None
        from ..manager import ChunkBlocks

        chunks = [ChunkBlocks(k, list(map(int, b))) for k, b in zip(keys, blocks, strict=True)]
        return self._call("save", lambda e: self.client.save(e, chunks), None)

    def restore(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]], *,
                layers: Sequence[int] | None = None) -> list[bytes]:
        """Restore each key into its blocks (only ``layers``' segments when given); the keys that missed
        (all of them when the call failed)."""
        if not keys:
            return []
        from ..manager import ChunkBlocks

        chunks = [ChunkBlocks(k, list(map(int, b))) for k, b in zip(keys, blocks, strict=True)]
        if layers is None:
            res = self._call("restore", lambda e: self.client.restore(e, chunks), None)
        else:
            res = self._call("restore", lambda e: self.client.restore(e, chunks, layers=list(layers)), None)
        if res is None:
            return list(keys)
        return [k for k, ok in zip(keys, res.restored, strict=True) if not ok]


class LayerLoadJob:
    """One engine step's loads, restored layer group by layer group in order, on a loader thread.

    ``groups`` are the layer groups in the order the forward pass reaches them. Within a group each transfer is one
    restore call; a transfer stops at its first missed chunk (a prefix is usable only up to its first
    hole), so later groups restore only what can still be used. :meth:`wait_layer` returns once the
    layer's group is written (or the job ended); :meth:`wait` returns the engine block ids that failed:
    every block from a transfer's first miss on, in any group.

    Invariants: waiters never hang on a job whose thread died (``run`` always ends the job); a bug in
    ``run`` is re-raised to the waiter of :meth:`wait` instead of being turned into a miss.
    """

    def __init__(self, session: "EngineSession | None", transfers: Sequence[Transfer],
                 groups: Sequence[Sequence[int]]) -> None:
        self.session = session
        self.transfers = list(transfers)
        self.groups = [list(g) for g in groups]
        self._group_of = {layer: gi for gi, g in enumerate(self.groups) for layer in g}
        self._cond = threading.Condition()
        self._done = 0  # groups [0, _done) are written
        self._finished = False
        self._error: BaseException | None = None
        self._failed: set[int] = set()
        self.started = self.ended = 0.0  # perf_counter() when run() began and ended

    def run(self) -> None:
        from ..manager import SKIP_BLOCK

        # Chunks [0, cut[i]) of transfer i have not missed in any group so far.
        cut = [len(t.keys) for t in self.transfers]
        self.started = time.perf_counter()
        try:
            for gi, group in enumerate(self.groups):
                for i, t in enumerate(self.transfers):
                    n = cut[i]
                    if n == 0:
                        continue
                    if self.session is None:
                        missed: Iterable[bytes] = t.keys[:n]
                    else:
                        missed = self.session.restore(t.keys[:n], t.blocks[:n], layers=group)
                    miss = set(missed)
                    cut[i] = next((j for j, k in enumerate(t.keys[:n]) if k in miss), n)
                with self._cond:
                    self._done = gi + 1
                    self._cond.notify_all()
        except BaseException as e:  # re-raised to wait(): a bug must surface, and waiters must not hang
            self._error = e
            cut = [0] * len(self.transfers)
        finally:
            failed = {b for t, n in zip(self.transfers, cut) for blocks in t.blocks[n:] for b in blocks
                      if b != SKIP_BLOCK}
            with self._cond:
                self._failed = failed
                self.ended = time.perf_counter()
                self._finished = True
                self._cond.notify_all()

    def wait_layer(self, layer: int | None) -> None:
        """Block until ``layer`` is written; an unknown layer (or None) waits for the whole job."""
        gi = self._group_of.get(layer) if layer is not None else None
        with self._cond:
            self._cond.wait_for(lambda: self._finished or (gi is not None and self._done > gi))

    def wait(self) -> set[int]:
        """Block until the job ended; the block ids that failed to load."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished)
        if self._error is not None:
            raise self._error
        return set(self._failed)

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished


class LayerLoader:
    """The loader thread of one worker: runs :class:`LayerLoadJob` s one after another (a step's loads
    start after the previous step's ended, which the engine guarantees by waiting for them)."""

    def __init__(self, name: str = "orbitkv-load") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def start(self, job: LayerLoadJob) -> LayerLoadJob:
        self._pool.submit(job.run)
        return job

    def close(self) -> None:
        """Wait for the running job, then stop the thread."""
        self._pool.shutdown(wait=True)


# ------------------------------------------------------------------------------- scheduler bookkeeping


@dataclass
class Transfer:
    """One load or save of a request: chunk keys and, per key, the engine blocks that hold it."""

    request_id: str
    keys: list[bytes]
    blocks: list[list[int]]


@dataclass
class _RequestState:
    keys: list[bytes]
    n_prompt: int
    block_ids: list[int] = field(default_factory=list)
    n_computed_local: int = 0
    saved_upto: int = 0  # chunks [0, saved_upto) are stored or being stored


class PrefixPlanner:
    """Scheduler-side state of a paged engine (vLLM-style), engine-agnostic: one chunk key per
    ``chunk_blocks`` consecutive blocks of a prompt (``keys[c]`` covers block positions
    ``[c * chunk_blocks, (c + 1) * chunk_blocks)``).

    Calls, in the engine's order: :meth:`matched` (lookup answer, in chunks), :meth:`allocated` (blocks
    given), :meth:`scheduled` (tokens computed this step), :meth:`take` (the step's loads and saves),
    :meth:`finished`. Only full prompt chunks are saved, each at most once, and chunks that were loaded
    from the store are not saved again. A load covers exactly the blocks the engine takes from the store:
    the positions of its first and last chunk outside them (the engine's own prefix-cache hit, blocks past
    what it may load) are :data:`~orbitkv_fs.manager.SKIP_BLOCK`, so blocks shared with other requests
    are never written.

    Larger chunks make larger segments (one per chunk, layer and K/V): the Manager's per-segment work is
    spread over more bytes (docs/engines.md has the figures), at the price of a prompt's last partial
    chunk not being stored.
    """

    def __init__(self, block_size: int, chunk_blocks: int = 1) -> None:
        if not isinstance(chunk_blocks, int) or chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be a positive integer, got {chunk_blocks!r}")
        self.math = BlockMath(block_size)
        self.chunk_blocks = chunk_blocks
        self._reqs: dict[str, _RequestState] = {}
        self._loads: list[Transfer] = []
        self._saves: list[Transfer] = []

    def matched(self, request_id: str, keys: Sequence[bytes], n_prompt: int, n_computed: int, hit_chunks: int) -> int:
        """Record a lookup (``hit_chunks``: the leading run of ``keys`` the store holds); return the
        tokens the engine may load beyond its ``n_computed``."""
        keys = keys if isinstance(keys, list) else list(keys)
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _RequestState(keys, n_prompt)
        st.keys, st.n_prompt, st.n_computed_local = keys, n_prompt, n_computed
        return self.math.new_matched_tokens(n_prompt, hit_chunks * self.chunk_blocks, n_computed)

    def allocated(self, request_id: str, block_ids: Sequence[int], n_external: int) -> None:
        """The engine gave the request ``block_ids`` (all of them, in token order) and will take
        ``n_external`` tokens from the store."""
        from ..manager import SKIP_BLOCK

        st = self._reqs.get(request_id)
        if st is None:
            return
        st.block_ids = list(block_ids)
        g = self.chunk_blocks
        first = st.n_computed_local // self.math.block_size
        end = first + n_external // self.math.block_size
        if end > first:
            c0, c1 = first // g, -(-end // g)
            blocks = [[st.block_ids[p] if first <= p < end else SKIP_BLOCK for p in range(c * g, (c + 1) * g)]
                      for c in range(c0, c1)]
            self._loads.append(Transfer(request_id, st.keys[c0:c1], blocks))
            # Every chunk the load touches is in the store (its last one may be loaded in part only); the
            # chunks before it were hits too.
            st.saved_upto = max(st.saved_upto, c1)
        else:
            # Chunks the engine holds in full need no save; one it holds in part is saved once complete.
            st.saved_upto = max(st.saved_upto, first // g)

    def scheduled(self, request_id: str, n_done_after_step: int, new_block_ids: Sequence[int] = (),
                  *, replace_blocks: bool = False) -> None:
        """The request's tokens ``[0, n_done_after_step)`` are computed once this step ran."""
        st = self._reqs.get(request_id)
        if st is None:
            return
        st.block_ids = list(new_block_ids) if replace_blocks else st.block_ids + list(new_block_ids)
        g = self.chunk_blocks
        blocks = min(self.math.full_blocks(min(n_done_after_step, st.n_prompt)), len(st.block_ids))
        done = min(blocks // g, len(st.keys))
        if done > st.saved_upto:
            self._saves.append(Transfer(request_id, st.keys[st.saved_upto:done],
                                        [st.block_ids[c * g:(c + 1) * g] for c in range(st.saved_upto, done)]))
            st.saved_upto = done

    def take(self) -> tuple[list[Transfer], list[Transfer]]:
        """The loads and saves planned since the last call."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def finished(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def keys(self, request_id: str) -> list[bytes] | None:
        """The keys recorded by :meth:`matched` (None before): a prompt's keys never change, and a
        scheduler asks again on every step a request waits."""
        st = self._reqs.get(request_id)
        return st.keys if st is not None else None

    def known(self, request_id: str) -> bool:
        return request_id in self._reqs


# ------------------------------------------------------------------------------ GPU pages (CUDA IPC)


CUDA_IPC_HANDLE_BYTES = 64
_TORCH_HANDLE_CUDA_MALLOC = ord("c")


def cuda_ipc_mem_handle(torch_handle: bytes) -> bytes | None:
    """The ``cudaIpcMemHandle_t`` inside a handle from torch's ``storage._share_cuda_()``, or None.

    torch's caching allocator writes ``[version][type][payload]``: type ``'c'`` is a plain cudaMalloc block
    followed by the 64-byte cudaIpcMemHandle_t (version 2 up to torch 2.12, 3 since, same payload); type
    ``'e'`` is an expandable segment, which cudaIpcOpenMemHandle cannot open. Old torch sent the bare 64 bytes.
    """
    if len(torch_handle) == CUDA_IPC_HANDLE_BYTES:
        return torch_handle
    if len(torch_handle) == CUDA_IPC_HANDLE_BYTES + 2 and torch_handle[1] == _TORCH_HANDLE_CUDA_MALLOC:
        return torch_handle[2:]
    return None


def layer_index(name: str) -> int | None:
    """The layer number in an engine's layer name, vLLM's rule (``extract_layer_index``): the one integer
    component of the dotted name (``model.layers.17.self_attn.attn`` -> 17, the model's global index, also
    on a later pipeline stage). None when there is not exactly one."""
    ints = [int(p) for p in name.split(".") if p.isdigit()]
    return ints[0] if len(ints) == 1 else None


def _shared_file_handle(address: int) -> object | None:
    """The :class:`~orbitkv_fs.geometry.HostPagesHandle` of host memory at ``address`` when it lies in a
    shared file mapping of this process (a pages file such as :class:`StagingPages`), else None."""
    from ..geometry import HostPagesHandle

    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if "s" not in parts[1] or not path.startswith("/") or path.endswith("(deleted)"):
                        return None
                    return HostPagesHandle(path, address - lo + int(parts[2], 16))
    except OSError:
        return None
    return None


def tensor_handle(t: "object") -> object | None:
    """The handle through which the Manager imports torch tensor ``t``'s memory: a CUDA IPC handle for a
    GPU tensor, the file and offset for a CPU tensor inside a shared pages file; None when the Manager
    cannot reach it (ordinary process memory, torch expandable segments)."""
    from ..geometry import CudaIpcHandle

    if not t.is_cuda:  # type: ignore[attr-defined]
        # A pages file holds C-contiguous tensors only: a strided view into one (vLLM's NHD or cross-layer
        # layouts) is not a tensor the Manager can import.
        if not t.is_contiguous():  # type: ignore[attr-defined]
            return None
        return _shared_file_handle(int(t.data_ptr()))  # type: ignore[attr-defined]
    # torch's caching allocator hands out slices of larger cudaMalloc blocks: the IPC handle names the
    # block, and the storage sits at an offset inside it.
    try:
        shared = t.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]  # (device, handle, size, offset, ...)
    except RuntimeError as e:
        # torch refuses IPC handles of memory from a pluggable allocator (vLLM's sleep mode allocates its KV
        # cache through cuMem) or from PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync. The adapter then stages
        # that KV (or stays off) instead of failing the worker.
        log.warning("OrbitKV-FS: a KV tensor's memory cannot be shared through CUDA IPC (%s)", e)
        return None
    base, size = int(shared[3]), int(shared[2])
    ipc = cuda_ipc_mem_handle(bytes(shared[1]))
    if ipc is None:
        log.warning("OrbitKV-FS: a KV tensor lives in memory CUDA IPC cannot share (torch expandable segments "
                    "or an unknown handle format); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
        return None
    return CudaIpcHandle(handle=ipc, offset=base + t.storage_offset() * t.element_size(),  # type: ignore[attr-defined]
                         device=t.device.index or 0, size=base + size)  # type: ignore[attr-defined]


def packed_registration(kv_caches: "dict[str, object]", *, model: str, block_size: int, engine_kind: str,
                        layers: Sequence[int] | None = None, num_layers: int | None = None,
                        engine_id: str | None = None, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                        pp_size: int = 1, codec: str | None = None, model_revision: str = "",
                        lookup_by_user: bool = False) -> object | None:
    """An :class:`~orbitkv_fs.geometry.EngineRegistration` of per-layer paged torch tensors in the packed
    ``[blocks, kv_heads, block_size, 2 * head_dim]`` layout (vLLM's), each shared through
    :func:`tensor_handle`. ``layers[i]`` is the model's global layer index of the ``i``-th entry (default:
    0, 1, ...); the stage range is ``[min, max + 1)`` of ``num_layers`` (default: the range's end) and must
    be complete. None when a tensor is not in that layout, the Manager cannot reach it, or the layers
    are not one contiguous stage (the adapter then stays off rather than guess). ``lookup_by_user``: see
    :attr:`~orbitkv_fs.geometry.EngineRegistration.lookup_by_user`."""
    from ..geometry import EngineRegistration, TensorDesc, process_start_time

    layers = list(range(len(kv_caches))) if layers is None else [int(x) for x in layers]
    if len(layers) != len(kv_caches) or not layers:
        log.warning("OrbitKV-FS: %d layer indices for %d KV tensors", len(layers), len(kv_caches))
        return None
    start, end = min(layers), max(layers) + 1
    total = end if num_layers is None else int(num_layers)
    if sorted(layers) != list(range(start, end)) or end > total:
        log.warning("OrbitKV-FS: KV layers %s are not one contiguous pipeline stage of %d layers", layers, total)
        return None
    tensors, geom = [], None
    for layer, (name, t) in zip(layers, kv_caches.items()):
        if t.dim() != 4 or t.shape[2] != block_size or t.shape[3] % 2:  # type: ignore[attr-defined]
            log.warning("OrbitKV-FS: layer %s %s is not a [blocks, heads, %d, 2*head_dim] tensor",
                        name, tuple(t.shape), block_size)  # type: ignore[attr-defined]
            return None
        g = (int(t.shape[1]), int(t.shape[3]) // 2, str(t.dtype).removeprefix("torch."))  # type: ignore[attr-defined]
        if geom not in (None, g):
            log.warning("OrbitKV-FS: layers disagree on heads/head_dim/dtype (%s vs %s)", geom, g)
            return None
        geom = g
        handle = tensor_handle(t)
        if handle is None:
            log.info("OrbitKV-FS: layer %s (%s) is in memory the Manager cannot map", name, t.device)  # type: ignore[attr-defined]
            return None
        tensors.append(TensorDesc(layer=layer, role="kv", layout="vllm_packed", shape=list(t.shape),  # type: ignore[attr-defined]
                                  strides=list(t.stride()), dtype=g[2], handle=handle, name=name))  # type: ignore[attr-defined]
    assert geom is not None
    heads, head_dim, dtype = geom
    return EngineRegistration(model=model, num_layers=total, layer_start=start, layer_end=end, block_size=block_size,
                              num_heads=heads, head_dim=head_dim, dtype=dtype, tensors=tensors,
                              model_revision=model_revision, engine_kind=engine_kind, tp_rank=tp_rank,
                              tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, codec=codec, engine_id=engine_id,
                              pid=os.getpid(), pid_start_time=process_start_time(os.getpid()),
                              lookup_by_user=lookup_by_user)


# ------------------------------------------------------------------------------------- staging pages


class StagingPages:
    """A shared-memory pages file the Manager imports, for adapters whose engine KV it cannot import.

    One ``vllm_packed``-layout tensor per layer, ``[slots, num_heads, block_size, 2 * head_dim]`` (K in
    the first half of the last axis, V in the second); a slot is one block. :meth:`registration`
    describes it; :meth:`key` / :meth:`value` are the ``[slots, num_heads, block_size, head_dim]`` numpy
    views the adapter copies engine KV into (before a save) and out of (after a restore). One tensor per
    layer (not one per layer and role) keeps the pages file's tensor table small.
    """

    def __init__(self, *, num_layers: int, slots: int, block_size: int, num_heads: int, head_dim: int,
                 dtype: str, directory: str = "/dev/shm", layer_start: int = 0,
                 total_layers: int | None = None) -> None:
        from ..pages import HostPages

        self.num_layers, self.slots, self.block_size = num_layers, slots, block_size
        self.num_heads, self.head_dim, self.dtype = num_heads, head_dim, dtype
        # A pipeline stage stages its own layers [layer_start, layer_start + num_layers) of total_layers.
        self.layer_start = layer_start
        self.total_layers = layer_start + num_layers if total_layers is None else total_layers
        self.layers = range(layer_start, layer_start + num_layers)
        specs = [(f"L{layer}", [slots, num_heads, block_size, 2 * head_dim], dtype, "kv") for layer in self.layers]
        self.pages = HostPages.create(specs, directory=directory)
        self._kv = [self.pages.array(f"L{layer}") for layer in self.layers]

    def key(self, layer: int) -> "object":
        """Slots of global layer ``layer``'s keys, ``[slots, num_heads, block_size, head_dim]``."""
        return self._kv[layer - self.layer_start][..., : self.head_dim]

    def value(self, layer: int) -> "object":
        return self._kv[layer - self.layer_start][..., self.head_dim :]

    @property
    def block_bytes(self) -> int:
        """Bytes of one slot of every layer (K and V)."""
        return sum(a[0].nbytes for a in self._kv)

    def registration(self, *, model: str, engine_kind: str, codec: str | None = None, engine_id: str | None = None,
                     tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                     model_revision: str = "") -> object:
        from ..geometry import EngineRegistration, process_start_time

        tensors = [self.pages.descriptor(f"L{layer}", layer=layer, layout="vllm_packed") for layer in self.layers]
        return EngineRegistration(
            model=model, num_layers=self.total_layers, layer_start=self.layer_start, layer_end=self.layers.stop,
            block_size=self.block_size, num_heads=self.num_heads, head_dim=self.head_dim, dtype=self.dtype,
            tensors=tensors, model_revision=model_revision, engine_kind=engine_kind, tp_rank=tp_rank,
            tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, codec=codec, engine_id=engine_id,
            pid=os.getpid(), pid_start_time=process_start_time(os.getpid()))

    def close(self) -> None:
        self._kv = []
        self.pages.close()
