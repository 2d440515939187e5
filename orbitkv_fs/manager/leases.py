"""Leases: what keeps DRAM extents from being evicted or overwritten while someone reads them.

Primitives: :class:`_Lease` (pinned chunks and leased (slot, generation) entries), :meth:`Leases._hand_out`
(an id and an expiry), :meth:`~Leases.release`, :meth:`~Leases._drop_lease`, :meth:`~Leases._lease_dram`
(a request's DRAM extents under one hold), :meth:`~Leases._expire_leases` (the housekeeping round).

State owned: ``_leases``, ``_lease_ids``, ``_expired`` (recently expired ids, so a late restore under one
is served). Invariants: an extent under a lease is never freed, evicted or overwritten; every lease is
dropped exactly once (release, the restore that consumes it, expiry, unregister or close); a caller
releases only its own engine's leases.
"""

from __future__ import annotations

import logging
import time

from ..access import Caller, authorize
from .api import LeaseError, UnknownEngine

log = logging.getLogger("orbitkv_fs.manager")


class _Lease:
    __slots__ = ("engine_id", "chunks", "entries", "expires")

    def __init__(self, engine_id: str | None) -> None:
        self.engine_id = engine_id
        self.chunks: list[bytes] = []  # pinned (namespace + chunk)
        self.entries: list[tuple[int, int]] = []  # leased (slot, generation)
        self.expires = float("inf")  # time.monotonic() deadline once handed out (lease_ttl)


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

    def _expire_leases(self) -> None:
        """Drop every lease past its expiry (the housekeeping thread's round)."""
        now = time.monotonic()
        with self._lock:
            expired = [(i, lease) for i, lease in self._leases.items() if lease.expires <= now]
            for i, lease in expired:
                del self._leases[i]
                self._expired[i] = lease.engine_id
                while len(self._expired) > _EXPIRED_IDS_KEPT:
                    self._expired.popitem(last=False)
                eng = self._engines.get(lease.engine_id) if lease.engine_id else None
                if eng is not None:
                    eng.leases.discard(i)
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
                eng.leases.discard(lease_id)
        self._drop_lease(lease)

    def _drop_lease(self, lease: _Lease) -> None:
        if lease.chunks:
            self.dram.unpin_chunks(lease.chunks)
            lease.chunks = []
        if lease.entries:
            self.dram.unlease(lease.entries)
            lease.entries = []

    def _lease_dram(self, kbs: list[bytes], held: _Lease, out: dict,
                    spans: dict[bytes, tuple[int, int]] | None = None) -> list[bytes]:
        """Lease the DRAM objects of ``kbs`` into ``held``, their views into ``out`` (or, with ``spans``,
        their arena ``(offset, length)`` into ``spans`` instead); the keys not there."""
        missing = []
        for kb, f in zip(kbs, self.dram.lease(kbs)):
            if f is None:
                missing.append(kb)
                continue
            slot, gen, off, length = f
            held.entries.append((slot, gen))
            if spans is None:
                out[kb] = memoryview(self.dram.view(off, length))
            else:
                spans[kb] = (off, length)
        return missing
