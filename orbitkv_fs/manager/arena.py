"""Direct access to the arena for peers and transfers (the Mooncake Transfer Engine writes into it).

Primitives: :meth:`ArenaAccess.lease_objects` (extents by key, lower-tier objects read back first, bounded),
:meth:`~ArenaAccess.read_object`, :meth:`~ArenaAccess.arena_info`, :meth:`~ArenaAccess.reserve` /
:meth:`~ArenaAccess.publish` / :meth:`~ArenaAccess.abort` (a transfer writes a segment in place),
:meth:`~ArenaAccess.set_peer_fetcher`.

State owned: ``_reservations``, ``_res_ids``. Invariants: a transferred segment is published only after
its header, key and CRC32C verify in place; a reservation is published or aborted exactly once.
"""

from __future__ import annotations

import logging
from typing import Sequence

from ..errors import SegmentError
from ..keys import ObjectKey
from ..segment import HEADER_SIZE, MAX_STORED_BYTES
from .api import ArenaInfo, ObjectExtent, PeerFetcher, PoolExhausted, RequestError
from .leases import _Lease
from .verify import _verify

log = logging.getLogger("orbitkv_fs.manager")


#: Segments one peer lease request may read back from the lower tier into DRAM.
_PEER_READMIT_SEGMENTS = 256


class ArenaAccess:
    """Arena access for peers and transfers."""

    def set_peer_fetcher(self, fetcher: PeerFetcher | None) -> None:
        self.peers = fetcher

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[ObjectExtent | None]]:
        """Lease the DRAM extents of ``keys`` (None where no tier has one DRAM can hold); release with
        :meth:`release`. Keys only the lower tier holds are first read back into DRAM (verified, at most
        :data:`_PEER_READMIT_SEGMENTS` per call), so peers are served SSD data too."""
        kbs = [k.pack() for k in keys]
        if self.lower is not None:
            self._readmit([(k, kb) for k, kb in zip(keys, kbs) if not self.dram.contains(kb)])
        lease = _Lease(None)
        out: list[ObjectExtent | None] = []
        for f in self.dram.lease(kbs):
            if f is None:
                out.append(None)
                continue
            slot, gen, off, length = f
            lease.entries.append((slot, gen))
            out.append(ObjectExtent(off, length, gen))
        if not lease.entries:
            return 0, out
        with self._lock:
            lease_id = self._hand_out(lease)
        return lease_id, out

    def _readmit(self, wanted: list[tuple[ObjectKey, bytes]]) -> None:
        """Read ``wanted`` objects the lower tier holds back into DRAM (bounded), for peers."""
        held = [(k, kb) for k, kb in wanted if self.lower.contains(k)][:_PEER_READMIT_SEGMENTS]
        if not held:
            return
        for (k, kb), blob in zip(held, self.lower.read_many([k for k, _ in held])):
            blob = self._checked_lower(kb, blob)
            if blob is not None:
                self._admit(kb, blob)

    def read_object(self, key: ObjectKey) -> bytes | None:
        """A verified copy of ``key``'s segment from DRAM or the lower tier (no peers, no promotion)."""
        kb = key.pack()
        blob = self.dram.read(kb)
        if blob is not None:
            try:
                _verify(kb, blob)
                return blob
            except SegmentError:
                self._add(decode_failures=1)
        if self.lower is not None:
            return self._read_lower(kb)
        return None

    def arena_info(self) -> ArenaInfo:
        a = self.dram.arena
        return ArenaInfo(path=a.path, size=a.size, base_address=a.base_address, pinned=a.pinned)

    def reserve(self, nbytes: int) -> ObjectExtent:
        """Reserve an arena extent (evicting if needed) for bytes a transfer writes in place; its
        ``generation`` is the reservation id. Counts in ``reserved_bytes`` until published or aborted."""
        if not HEADER_SIZE <= nbytes <= HEADER_SIZE + MAX_STORED_BYTES:
            raise RequestError(f"cannot reserve {nbytes} bytes for one segment")
        off = self.dram.reserve(nbytes)
        if off is None:
            raise PoolExhausted(f"no room for {nbytes} bytes: the pool is full of leased objects")
        rid = next(self._res_ids)
        with self._lock:
            self._reservations[rid] = (off, nbytes)
        return ObjectExtent(off, nbytes, rid)

    def publish(self, reservation: ObjectExtent, key: ObjectKey) -> bool:
        """Verify the segment written into ``reservation`` (header, key's layer/role, CRC) and publish it
        under ``key``; on failure the extent is freed and False returned."""
        with self._lock:
            res = self._reservations.pop(reservation.generation, None)
        if res is None or res != (reservation.offset, reservation.length):
            raise RequestError(f"unknown reservation {reservation.generation}")
        off, n = res
        kb = key.pack()
        try:
            h = _verify(kb, memoryview(self.dram.view(off, n)))
        except SegmentError as e:
            log.warning("transferred segment for %s is bad: %s", key, e)
            self._add(decode_failures=1)
            self.dram.cancel(off, n)
            return False
        return self.dram.publish(kb, off, n, h.original_length, int(h.format)) is not None

    def abort(self, reservation: ObjectExtent) -> None:
        with self._lock:
            res = self._reservations.pop(reservation.generation, None)
        if res is None:
            raise RequestError(f"unknown reservation {reservation.generation}")
        self.dram.cancel(*res)
