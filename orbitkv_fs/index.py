"""The DRAM object index: packed key -> slot, with per-slot columns and per-chunk presence counts.

Sized for millions of segments (target: <= 256 bytes a segment): a slot is a row of ``array`` columns
(extent, lengths, generation, lease count, representation, state) plus one dict entry keyed by the
36-byte packed :class:`~orbitkv_fs.keys.ObjectKey`; the per-chunk count (namespace + chunk -> segments
published) makes a lookup one dict probe per chunk instead of one per layer.

Primitives: :meth:`ObjectIndex.add`, :meth:`~ObjectIndex.get`, :meth:`~ObjectIndex.hide`,
:meth:`~ObjectIndex.free`, :meth:`~ObjectIndex.chunk_count`, :meth:`~ObjectIndex.slots`.

States: FREE (row unused) -> LIVE (published: in the dict, counted in its chunk) -> HIDDEN (evicted or
invalidated while leased: out of the dict and the chunk count, extent still allocated) -> FREE (once no
lease remains). Invariants: a LIVE or HIDDEN row owns its extent; generations are unique and never reused,
so (slot, generation) names one publication. Not thread-safe: the DRAM tier serialises access.
"""

from __future__ import annotations

from array import array
from typing import Iterator

FREE, LIVE, HIDDEN = 0, 1, 2
_KEY_NS_CHUNK = 32  # bytes of the packed key that name (namespace, chunk)


class ObjectIndex:
    def __init__(self) -> None:
        self._map: dict[bytes, int] = {}
        self.chunks: dict[bytes, int] = {}
        self.keys: list[bytes | None] = []
        self.offset = array("I")  # in allocation units
        self.units = array("I")
        self.length = array("I")  # stored segment bytes (header + payload)
        self.logical = array("I")  # source bytes
        self.generation = array("Q")
        self.leases = array("I")
        self.rep = array("B")  # segment Format
        self.state = array("B")
        self._free: array = array("i")
        self._next_gen = 1

    def __len__(self) -> int:
        return len(self._map)

    def add(self, key: bytes, offset: int, units: int, length: int, logical: int, rep: int) -> tuple[int, int]:
        """Publish ``key`` (absent) at ``offset``; returns ``(slot, generation)``."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self.keys)
            self.keys.append(None)
            for col in (self.offset, self.units, self.length, self.logical, self.generation, self.leases):
                col.append(0)
            self.rep.append(0)
            self.state.append(FREE)
        gen = self._next_gen
        self._next_gen += 1
        self.keys[slot] = key
        self.offset[slot], self.units[slot], self.length[slot] = offset, units, length
        self.logical[slot], self.generation[slot], self.leases[slot] = logical, gen, 0
        self.rep[slot], self.state[slot] = rep, LIVE
        self._map[key] = slot
        c = key[:_KEY_NS_CHUNK]
        self.chunks[c] = self.chunks.get(c, 0) + 1
        return slot, gen

    def get(self, key: bytes) -> int | None:
        return self._map.get(key)

    def chunk_count(self, ns_chunk: bytes) -> int:
        """Published segments of (namespace + chunk), 32 bytes."""
        return self.chunks.get(ns_chunk, 0)

    def hide(self, slot: int) -> None:
        """LIVE -> HIDDEN: invisible to new readers, extent kept for the leases still on it."""
        key = self.keys[slot]
        assert key is not None and self.state[slot] == LIVE
        del self._map[key]
        c = key[:_KEY_NS_CHUNK]
        n = self.chunks[c] - 1
        if n:
            self.chunks[c] = n
        else:
            del self.chunks[c]
        self.state[slot] = HIDDEN

    def free(self, slot: int) -> None:
        """HIDDEN -> FREE (the caller frees the extent)."""
        assert self.state[slot] == HIDDEN and self.leases[slot] == 0
        self.keys[slot] = None
        self.state[slot] = FREE
        self._free.append(slot)

    def slots(self) -> Iterator[int]:
        """Slots of the LIVE objects (snapshot; safe to hide while iterating)."""
        return iter(list(self._map.values()))

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter(list(self._map.items()))
