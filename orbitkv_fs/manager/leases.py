"""Leases: what keeps DRAM extents from being evicted or overwritten while someone reads them.

Primitives: :class:`_Lease` (pinned chunks and leased (slot, generation) entries, one by one or as arrays),
:meth:`Leases._hand_out` (an id and an expiry), :meth:`~Leases._hand_out_to` (a lookup's lease, within its
engine's bounds), :meth:`~Leases.release`, :meth:`~Leases._drop_lease`, :meth:`~Leases._forget_lease`,
:meth:`~Leases._lease_dram` (a request's DRAM extents under one hold: views, or :class:`Spans`, their places
as arrays in the request's key order), :meth:`~Leases._expire_leases` (the housekeeping round).

State owned: ``_leases``, ``_lease_ids``, ``_expired`` (recently expired or displaced ids, so a late restore
under one is served), each engine's ``leases`` (id -> chunks pinned, oldest first) and ``leased_chunks``.
Invariants: an extent under a lease is never freed, evicted or overwritten; every lease is dropped exactly
once (release, the restore that consumes it, expiry, displacement, unregister or close); a caller releases
only its own engine's leases; an engine holds at most ``max_leases_per_engine`` leases and
``max_leased_chunks_per_engine`` chunks under them, so a process that looks up without end and never
releases costs bounded memory.
"""

from __future__ import annotations

import logging
import time
from itertools import compress
from typing import Sequence

import numpy as np

from ..access import Caller, authorize
from .api import LeaseError, UnknownEngine
from .registry import _Engine

log = logging.getLogger("orbitkv_fs.manager")


class _Lease:
    __slots__ = ("engine_id", "chunks", "entries", "rows", "expires")

    def __init__(self, engine_id: str | None) -> None:
        self.engine_id = engine_id
        self.chunks: list[bytes] = []  # pinned (namespace + chunk)
        self.entries: list[tuple[int, int]] = []  # leased (slot, generation)
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []  # leased slots and their generations, as arrays
        self.expires = float("inf")  # time.monotonic() deadline once handed out (lease_ttl)


class Spans:
    """The DRAM extents a request leased, as arrays in its key order: ``offs[i]``, ``lens[i]`` are the arena
    offset and length of ``keys[i]``, -1 where DRAM had no object for it; ``hit`` says which. The batch checks
    read the arrays; the per-segment paths ask one key at a time (``get``, ``in``, ``[]``: a key -> position
    dict, made on first use)."""

    __slots__ = ("keys", "hit", "offs", "lens", "_at")

    def __init__(self) -> None:
        self.keys: Sequence[bytes] = ()
        self.hit = np.zeros(0, dtype=bool)
        self.offs = self.lens = np.zeros(0, dtype=np.int64)
        self._at: dict[bytes, int] | None = None

    def fill(self, keys: Sequence[bytes], hit: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> None:
        """``keys`` and, for those ``hit``, their extents (``offs``, ``lens`` of the hits, in key order)."""
        self.keys, self.hit, self._at = keys, hit, None
        self.offs = np.full(len(keys), -1, dtype=np.int64)
        self.lens = np.full(len(keys), -1, dtype=np.int64)
        self.offs[hit] = offs
        self.lens[hit] = lens

    def joined(self, other: "Spans") -> "Spans":
        """These keys' extents followed by ``other`` 's: one request leased in two parts."""
        out = Spans()
        out.keys = list(self.keys) + list(other.keys)
        out.hit = np.concatenate((self.hit, other.hit))
        out.offs = np.concatenate((self.offs, other.offs))
        out.lens = np.concatenate((self.lens, other.lens))
        return out

    def __len__(self) -> int:
        return int(np.count_nonzero(self.hit))

    def get(self, kb: bytes, default: "tuple[int, int] | None" = None) -> "tuple[int, int] | None":
        if self._at is None:
            self._at = dict(zip(compress(self.keys, self.hit.tolist()), np.flatnonzero(self.hit).tolist()))
        i = self._at.get(kb)
        return default if i is None else (int(self.offs[i]), int(self.lens[i]))

    def __contains__(self, kb: bytes) -> bool:
        return self.get(kb) is not None

    def __getitem__(self, kb: bytes) -> tuple[int, int]:
        got = self.get(kb)
        if got is None:
            raise KeyError(kb)
        return got


#: Expired lease ids remembered so that a late restore under one is served, not refused.
_EXPIRED_IDS_KEPT = 4096


class Leases:
    """The lease table: hand-out, release, expiry."""

    def _hand_out(self, lease: _Lease) -> int:
        """Register ``lease`` under a new id with its expiry; answers the id. Called with ``_lock`` held."""
        lease_id = next(self._lease_ids)
        if self._config.lease_ttl > 0:
            lease.expires = time.monotonic() + self._config.lease_ttl
            self._start_housekeeping()
        self._leases[lease_id] = lease
        return lease_id

    def _hand_out_to(self, eng: _Engine, lease: _Lease) -> int:
        """Hand a lookup's ``lease`` (its pinned chunks) to ``eng`` within the engine's bounds: its oldest
        leases end first where the new one would pass ``max_leases_per_engine`` or
        ``max_leased_chunks_per_engine`` (remembered as expired: a restore under one still runs). A lease
        over the chunk bound by itself is not handed out: its pins are dropped and the answer is 0."""
        c = self._config
        size = len(lease.chunks)
        displaced: list[_Lease] = []
        lease_id = 0
        with self._lock:
            if size <= c.max_leased_chunks_per_engine:
                while eng.leases and (len(eng.leases) >= c.max_leases_per_engine
                                      or eng.leased_chunks + size > c.max_leased_chunks_per_engine):
                    oldest = next(iter(eng.leases))
                    self._forget_lease(eng, oldest)
                    old = self._leases.pop(oldest, None)
                    if old is not None:
                        self._remember_ended(oldest, eng.info.engine_id)
                        displaced.append(old)
                lease_id = self._hand_out(lease)
                eng.leases[lease_id] = size
                eng.leased_chunks += size
        for old in displaced:
            self._drop_lease(old)
        if not lease_id:  # over the bound by itself: its pins go, and the lookup is answered without a lease
            self._drop_lease(lease)
            self._add(leases_refused=1)
            self._warn_bounds(eng, f"looked up a run of {size} chunks, over --max-leased-chunks-per-engine "
                                   f"{c.max_leased_chunks_per_engine}: answered without a lease")
        elif displaced:
            self._add(leases_displaced=len(displaced))
            self._warn_bounds(eng, f"holds {c.max_leases_per_engine} leases or {c.max_leased_chunks_per_engine} "
                                   "chunks under them (--max-leases-per-engine, --max-leased-chunks-per-engine): "
                                   "its oldest leases end early; it should restore or release what it looks up")
        return lease_id

    @staticmethod
    def _warn_bounds(eng: _Engine, what: str) -> None:
        """At most one line per engine and 10 s: a process that never releases would otherwise log per call."""
        now = time.monotonic()
        if now - eng.displace_warned < 10.0:
            return
        eng.displace_warned = now
        log.warning("engine %r %s", eng.info.engine_id, what)

    @staticmethod
    def _forget_lease(eng: _Engine, lease_id: int) -> None:
        """Take ``lease_id`` off its engine's books (called with ``_lock`` held; an id not there is ignored)."""
        eng.leased_chunks -= eng.leases.pop(lease_id, 0)

    def _remember_ended(self, lease_id: int, engine_id: str | None) -> None:
        """Keep an ended lease's id for a while, so that a late restore under it is served (``_lock`` held)."""
        self._expired[lease_id] = engine_id
        while len(self._expired) > _EXPIRED_IDS_KEPT:
            self._expired.popitem(last=False)

    def _expire_leases(self) -> None:
        """Drop every lease past its expiry (the housekeeping thread's round)."""
        now = time.monotonic()
        with self._lock:
            expired = [(i, lease) for i, lease in self._leases.items() if lease.expires <= now]
            for i, lease in expired:
                del self._leases[i]
                self._remember_ended(i, lease.engine_id)
                eng = self._engines.get(lease.engine_id) if lease.engine_id else None
                if eng is not None:
                    self._forget_lease(eng, i)
        for _, lease in expired:
            self._drop_lease(lease)
        if expired:
            self._add(leases_expired=len(expired))
            log.warning("%d lease(s) expired after %gs without a restore or release (lease ids %s)", len(expired),
                        self._config.lease_ttl, ", ".join(str(i) for i, _ in expired[:8]))

    def release(self, lease_id: int, *, engine_id: str | None = None, caller: Caller | None = None) -> None:
        """Drop a lease from :meth:`lookup` or :meth:`lease_objects`. With ``caller``, only a lease of
        ``engine_id`` that the caller may act for (never a peer's). Raises :class:`LeaseError`."""
        with self._lock:
            if caller is not None:
                eng = self._engines.get(engine_id or "")
                if eng is None or eng.closing:
                    raise UnknownEngine(f"no engine {engine_id!r} is registered")
                authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
                mine = self._leases.get(lease_id)
                if (mine.engine_id if mine is not None else self._expired.get(lease_id)) != engine_id:
                    raise LeaseError(f"lease {lease_id} is not held by engine {engine_id!r}")
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                if lease_id in self._expired:  # expired already: nothing left to drop
                    return
                raise LeaseError(f"unknown lease {lease_id}")
            eng = self._engines.get(lease.engine_id) if lease.engine_id else None
            if eng is not None:
                self._forget_lease(eng, lease_id)
        self._drop_lease(lease)

    def _drop_lease(self, lease: _Lease) -> None:
        if lease.chunks:
            self.dram.unpin_chunks(lease.chunks)
            lease.chunks = []
        if lease.entries:
            self.dram.unlease(lease.entries)
            lease.entries = []
        while lease.rows:
            self.dram.unlease_rows(*lease.rows.pop())

    def _lease_dram(self, kbs: list[bytes], held: _Lease, out: dict, spans: Spans | None = None,
                    runs: "tuple[np.ndarray, list[int]] | None" = None) -> list[bytes]:
        """Lease the DRAM objects of ``kbs`` into ``held``, their views into ``out`` (or, with ``spans``,
        their arena extents into ``spans`` instead, as arrays: nothing per key); the keys not there. ``runs``:
        the keys' scan (:meth:`~orbitkv_fs.index.ObjectIndex.get_many`), where the caller made them."""
        if spans is not None:
            got = self.dram.lease_rows(kbs, runs=runs)
            if len(got.slots):
                held.rows.append((got.slots, got.gens))
            spans.fill(kbs, got.hit, got.offs, got.lens)
            return [] if len(got.slots) == len(kbs) else list(compress(kbs, (~got.hit).tolist()))
        missing = []
        for kb, f in zip(kbs, self.dram.lease(kbs)):
            if f is None:
                missing.append(kb)
                continue
            slot, gen, off, length = f
            held.entries.append((slot, gen))
            out[kb] = memoryview(self.dram.view(off, length))
        return missing
