"""The SSD tier's index: each key's newest published record, the segments submitted and not yet written,
and the byte gauges of the records in the rings.

Primitives: the ``dict`` operations (``get``, ``in``, ``len``, ``items``); :meth:`SsdIndex.publish` (a
completed write replaces its key's older record); :meth:`SsdIndex.kill` (hide a record at once: corrupt,
invalidated, superseded); :meth:`SsdIndex.release` (the ring takes a record's space back);
:meth:`SsdIndex.add_dead` (a record that never became readable still occupies space); ``pending`` (key ->
the generation and segment of its newest submit whose write has not completed: readers are served a
copy of it meanwhile, made under the tier's lock, since the segment is a view of the write's staging
buffer, recycled when the write ends).

Invariants: the index holds only COMMITTED slots, at most one per key, the one of the highest generation
published; ``live`` is the bytes of those slots, ``dead`` the bytes of DEAD slots still in a ring. Not
thread-safe: the tier's lock guards it.
"""

from __future__ import annotations

from ...keys import ObjectKey
from .ring import Slot, State


class SsdIndex(dict):
    """``key -> Slot`` (a ``dict``: a lookup or ``in`` runs at C speed, once per key of every read), with
    the pending segments and the byte gauges beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[ObjectKey, tuple[int, memoryview]] = {}
        self.live = 0
        self.dead = 0

    def publish(self, s: Slot) -> bool:
        """A completed write of ``s``: it becomes its key's record unless a newer generation was published
        meanwhile (then it is DEAD; answers False)."""
        old = self.get(s.key)
        if old is not None and old.generation > s.generation:
            self.add_dead(s)
            return False
        if old is not None:
            self.kill(old)
        s.state = State.COMMITTED
        self.live += s.length
        self[s.key] = s
        return True

    def kill(self, s: Slot) -> None:
        """Hide a committed record from readers now; its space is reclaimed when unleased."""
        if s.state is State.COMMITTED:
            if self.get(s.key) is s:
                del self[s.key]
            self.live -= s.length
            self.dead += s.length
            s.state = State.DEAD

    def release(self, s: Slot) -> bool:
        """The ring reuses ``s``'s space: forget it. Answers True when it was readable (an eviction)."""
        if s.state is State.COMMITTED:
            if self.get(s.key) is s:
                del self[s.key]
            self.live -= s.length
            return True
        self.dead -= s.length
        return False

    def add_dead(self, s: Slot) -> None:
        s.state = State.DEAD
        self.dead += s.length
