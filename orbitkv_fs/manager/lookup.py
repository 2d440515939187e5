"""Lookup: the leading run of a request's chunks present in full, under a lease.

Primitives: :meth:`Lookup.lookup` (DRAM first, then promotion from the lower tier, then the chunks peers
say they hold).

Invariants: a counted chunk has every (layer, role) segment of the engine; with ``lease`` the DRAM extents
of the counted run stay pinned until the restore or release that ends the lease; a failing lower tier
hands out no lease.
"""

from __future__ import annotations

import logging
from typing import Sequence

from ..access import Caller
from .api import LookupResult
from .leases import _Lease
from .verify import _check_keys

log = logging.getLogger("orbitkv_fs.manager")


class Lookup:
    """Lookups."""

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True,
               caller: Caller | None = None) -> LookupResult:
        """Length of the leading run of ``chunks`` present in full. Lower-tier objects of that run are
        promoted to DRAM; with ``lease`` the run's extents stay leased until :meth:`restore` (given the
        lease id) or :meth:`release`."""
        eng = self._enter(engine_id, caller, lookup=not lease)
        try:
            for c in chunks:
                if type(c) is not bytes or len(c) != 16:
                    _check_keys(chunks)  # raises naming the bad key (a bytes subclass passes)
                    break
            nseg = len(eng.segs)
            pin = _Lease(engine_id)
            ns_chunks = list(map(eng.ns.__add__, chunks))
            n_dram = self.dram.leading_complete(ns_chunks, nseg, pin=lease)
            if lease:
                pin.chunks.extend(ns_chunks[:n_dram])
            n_lower = 0
            if self.lower is not None and n_dram < len(chunks):
                try:
                    n_lower = self._promote_run(eng, chunks[n_dram:], pin if lease else None)
                except BaseException:  # the lower tier failed: no lease is handed out, so no pin stays
                    self._drop_lease(pin)
                    raise
            count = n_dram + n_lower
            self._remember_prefix(eng, chunks)
            if n_lower:
                self._readahead(eng, chunks[count - 1], set(chunks))
            n_peer = 0
            if count < len(chunks) and self.peers is not None:
                layers = [(s.layer, int(s.role)) for s in eng.segs]
                try:
                    n_peer = max(0, min(len(chunks) - count, self.peers.lookup_prefix(eng.ns, chunks[count:], layers)))
                except Exception as e:  # a peer failure is a miss, never a failed lookup
                    log.warning("peer lookup failed: %s", e)
            lease_id = self._hand_out_to(eng, pin) if pin.chunks else 0
            with self._stat_lock:  # not _add: its keyword loop costs more than the counting
                self._c["lookups"] += 1
                self._c["lookup_chunks_hit"] += count + n_peer
            return LookupResult(count=count + n_peer, lease_id=lease_id, dram=n_dram, lower=n_lower, peer=n_peer)
        finally:
            self._exit(eng)
