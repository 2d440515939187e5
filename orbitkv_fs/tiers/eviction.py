"""Eviction policies over index slots: LRU and S3-FIFO (byte-weighted queues), lease-aware.

A policy orders slot ids (small ints owned by :class:`orbitkv_fs.index.ObjectIndex`) and, asked for a
victim, names the next slot to evict. Primitives: ``insert(slot, nbytes, key_hash)`` (and ``insert_many``
of a batch's slots, in order), ``touch(slot)``, ``touch_many(slots)`` (``touch`` of each, in order), ``remove(slot)``,
``victim(pinned) -> slot | None``, ``take(need, units, pinned) -> slots`` (the victims, removed, until their
units reach ``need``: a save batch's room in one call), ``remember(key_hash)`` / ``remember_many(key_hashes)``
and :func:`make_policy`.

* ``lru``: one doubly linked list; touch moves to the head, victims come from the tail.
* ``s3fifo`` (Yang et al., SOSP '23): a small FIFO (10% of the bytes), a main FIFO and a ghost FIFO of
  recently evicted key hashes. New objects enter the small queue (the main queue when their hash is a
  ghost); an object leaving the small queue that was touched moves to main, otherwise it is evicted and
  remembered as a ghost; main gives objects with a nonzero frequency another round (frequency - 1).
  One-hit scans therefore pass through the small queue without flushing the main queue.

Invariants: every linked slot is in exactly one queue; ``victim`` never returns a slot for which
``pinned(slot)`` is true (a leased extent): pinned slots are rotated to the head instead, and after a full
round of pinned slots ``victim`` answers None. The lists live in ``array`` columns, not in per-object
Python objects, to keep the index small: 9 bytes a slot for LRU (links and queue), 14 for S3-FIFO (plus
size and frequency); the ghost FIFO holds hashes of evicted keys only, at most max(main length, 1024).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import numba
import numpy as np

from ..index import put_columns, put_rows

_NIL = -1
#: LruPolicy.touch_many looks for one run among batches of at least this many slots.
_TOUCH_RUN_MIN = 16


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _linked_run(slots: np.ndarray, queue: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, bool]:
    """The ``slots`` linked in list 0 (``queue[s] == 0``; slots past the columns are not), in order, and whether
    there are some and each one's ``next`` is the one before it (the last of them -> ... -> the first is a run
    of the list): :meth:`LruPolicy.touch_many` 's test, one pass."""
    at = np.empty(slots.shape[0], np.int64)
    m = 0
    for s in slots:
        if 0 <= s < queue.shape[0] and queue[s] == 0:
            at[m] = s
            m += 1
    run = m > 0
    for i in range(1, m):
        if nxt[at[i]] != at[i - 1]:
            run = False
            break
    return at[:m], run


class _Lists:
    """Doubly linked lists over slot ids in array columns; list ``q`` has head[q]/tail[q]. ``weighted``
    lists also keep each slot's byte size and a frequency counter (S3-FIFO); LRU needs neither."""

    def __init__(self, queues: int, *, weighted: bool) -> None:
        self.prev = array("i")
        self.next = array("i")
        self.queue = array("b")
        self.size = array("I")
        self.freq = array("B")
        self.weighted = weighted
        self.head = [_NIL] * queues
        self.tail = [_NIL] * queues
        self.count = [0] * queues
        self.bytes = [0] * queues

    def _grow(self, slot: int) -> None:
        # To the rows needed only: array's own over-allocation (1/16) amortises it, and the columns stay
        # within a few percent of the slot count instead of growing by halves.
        add = slot + 1 - len(self.prev)
        if add > 0:
            nil = (_NIL,) * add  # also the queue column's "in no list"
            self.prev.extend(nil)
            self.next.extend(nil)
            self.queue.extend(nil)
            if self.weighted:
                zero = (0,) * add
                self.size.extend(zero)
                self.freq.extend(zero)

    def push_head(self, q: int, slot: int, nbytes: int) -> None:
        self._grow(slot)
        h = self.head[q]
        self.prev[slot] = _NIL
        self.next[slot] = h
        if h != _NIL:
            self.prev[h] = slot
        else:
            self.tail[q] = slot
        self.head[q] = slot
        self.queue[slot] = q
        self.count[q] += 1
        if self.weighted:
            self.size[slot] = nbytes
            self.bytes[q] += nbytes

    def push_head_many(self, q: int, slots: Sequence[int], nbytes: Sequence[int]) -> None:
        """:meth:`push_head` of each slot in order (the last one ends at the head), in one step."""
        k = len(slots)
        if k <= 1:
            if k:
                self.push_head(q, int(slots[0]), int(nbytes[0]))
            return
        slots = np.asarray(slots, dtype=np.int64)  # a save batch's arrays, or a list: written with numpy
        self._grow(int(slots.max()))
        h = self.head[q]
        first, last = int(slots[0]), int(slots[k - 1])
        # In order: each slot's next is the one pushed before it (the old head for the first), its prev the
        # one pushed after it (none for the last).
        cols: list = [self.next, self.prev, self.queue]
        vals: list = [np.concatenate(([h], slots[:k - 1])), np.concatenate((slots[1:], [_NIL])), q]
        if self.weighted:
            cols.append(self.size)
            vals.append(nbytes)
            self.bytes[q] += int(np.sum(nbytes))
        put_columns(cols, slots, vals)
        if h != _NIL:
            self.prev[h] = first
        else:
            self.tail[q] = first
        self.head[q] = last
        self.count[q] += k

    def to_head(self, q: int, slot: int) -> None:
        """Move ``slot``, linked in list ``q``, to that list's head: :meth:`unlink` then :meth:`push_head`
        in one step (an LRU touch, once per segment a restore leases)."""
        h = self.head[q]
        if h == slot:
            return
        prev, nxt = self.prev, self.next
        p, n = prev[slot], nxt[slot]  # p is linked: slot is not the head
        nxt[p] = n
        if n != _NIL:
            prev[n] = p
        else:
            self.tail[q] = p
        prev[slot] = _NIL
        nxt[slot] = h
        prev[h] = slot
        self.head[q] = slot

    def unlink(self, slot: int) -> int:
        """Remove ``slot`` from its list; returns the list it was in (-1 when unlinked)."""
        if slot >= len(self.queue):
            return -1
        q = self.queue[slot]
        if q < 0:
            return -1
        p, n = self.prev[slot], self.next[slot]
        if p != _NIL:
            self.next[p] = n
        else:
            self.head[q] = n
        if n != _NIL:
            self.prev[n] = p
        else:
            self.tail[q] = p
        self.queue[slot] = -1
        self.count[q] -= 1
        if self.weighted:
            self.bytes[q] -= self.size[slot]
        return q


class LruPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._l = _Lists(1, weighted=False)

    def insert(self, slot: int, nbytes: int, key_hash: int) -> None:  # noqa: ARG002
        self._l.push_head(0, slot, nbytes)

    def insert_many(self, slots: Sequence[int], nbytes: Sequence[int], key_hashes: Iterable[int]) -> None:  # noqa: ARG002
        """:meth:`insert` of each, in order (``key_hashes`` is not read: it may be a lazy map)."""
        self._l.push_head_many(0, slots, nbytes)

    def touch(self, slot: int) -> None:
        l = self._l
        if slot < len(l.queue) and l.queue[slot] == 0:
            l.to_head(0, slot)

    def touch_many(self, slots: "Sequence[int] | np.ndarray") -> None:
        """:meth:`touch` of each of ``slots`` in order (a restore's leases), the same list as one by one: the
        slots touched end at the head, the last touched first. Where the slots already lie side by side in
        that order (a chunk range saved, or restored, in the same key order as now: the common case), the run
        moves to the head in one step; otherwise they move one by one."""
        l = self._l
        n = len(l.queue)
        if len(slots) >= _TOUCH_RUN_MIN:
            # touch ignores unlinked slots
            at, run = _linked_run(np.asarray(slots, dtype=np.int64), np.frombuffer(l.queue, dtype=np.int8),
                                  np.frombuffer(l.next, dtype=np.int32))
            if run:
                # at[-1] -> ... -> at[0] is a run of the list (so its slots are distinct): unlink it whole
                # and put it at the head.
                first, last = int(at[-1]), int(at[0])
                prev, nxt = l.prev, l.next
                p, q = prev[first], nxt[last]
                if p == _NIL:  # at the head already
                    return
                nxt[p] = q
                if q != _NIL:
                    prev[q] = p
                else:
                    l.tail[0] = p
                h = l.head[0]
                prev[first] = _NIL
                nxt[last] = h
                prev[h] = last
                l.head[0] = first
                return
        for slot in (slots.tolist() if isinstance(slots, np.ndarray) else slots):
            if slot < n and l.queue[slot] == 0:
                l.to_head(0, slot)

    def remove(self, slot: int) -> None:
        self._l.unlink(slot)

    def remember(self, key_hash: int) -> None:
        """LRU keeps no history of evicted keys."""

    def remember_many(self, key_hashes: Iterable[int]) -> None:
        """Nothing, as :meth:`remember` (``key_hashes`` is not read: it may be a lazy map)."""

    def take(self, need: int, units: Sequence[int], pinned: Callable[[int], bool]) -> list[int]:
        """Victims, least recent first, removed from the list, until their ``units[slot]`` sum to ``need`` or
        more (fewer when only pinned slots are left): what :meth:`victim` and :meth:`remove` of each would
        give, the pinned slots met on the way rotated to the head in the order met. One walk from the tail;
        the victims, a run at the tail once the pinned ones have left it, are cut off in one step."""
        l = self._l
        prev = l.prev
        out: list[int] = []
        rotate: list[int] = []
        got = 0
        s = l.tail[0]
        for _ in range(l.count[0]):
            if got >= need:
                break
            if pinned(s):
                rotate.append(s)
            else:
                out.append(s)
                got += units[s]
            s = prev[s]
        for s in rotate:
            l.to_head(0, s)
        if out:
            last = out[-1]  # the victim nearest the head: the list goes on from its prev
            p = prev[last]
            if p == _NIL:
                l.head[0] = l.tail[0] = _NIL
            else:
                l.next[p] = _NIL
                l.tail[0] = p
            put_rows(l.queue, out, [-1] * len(out))
            l.count[0] -= len(out)
        return out

    def victim(self, pinned: Callable[[int], bool]) -> int | None:
        l = self._l
        for _ in range(l.count[0]):
            s = l.tail[0]
            if not pinned(s):
                return s
            self.touch(s)
        return None

    def __len__(self) -> int:
        return self._l.count[0]


_SMALL, _MAIN = 0, 1


class S3FifoPolicy:
    name = "s3fifo"
    SMALL_FRACTION = 0.10
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._l = _Lists(2, weighted=True)
        self._ghost: OrderedDict[int, None] = OrderedDict()

    def insert(self, slot: int, nbytes: int, key_hash: int) -> None:
        self.insert_many((slot,), (nbytes,), (key_hash,))

    def insert_many(self, slots: Sequence[int], nbytes: Sequence[int], key_hashes: Iterable[int]) -> None:
        """:meth:`insert` of each, in order: a slot whose key hash is a ghost goes to the main queue (its
        ghost dropped), the others to the small one; each queue takes its slots in one step."""
        l, ghost = self._l, self._ghost
        if ghost:
            to_main = []
            for h in key_hashes:
                hit = h in ghost
                if hit:
                    del ghost[h]
                to_main.append(hit)
            if any(to_main):
                main = np.asarray(to_main)
                slots, nbytes = np.asarray(slots, dtype=np.int64), np.asarray(nbytes, dtype=np.int64)
                l.push_head_many(_SMALL, slots[~main], nbytes[~main])
                l.push_head_many(_MAIN, slots[main], nbytes[main])
                put_rows(l.freq, slots, [0] * len(slots))
                return
        l.push_head_many(_SMALL, slots, nbytes)
        put_rows(l.freq, slots, [0] * len(slots))

    def touch(self, slot: int) -> None:
        l = self._l
        if slot < len(l.queue) and l.queue[slot] >= 0 and l.freq[slot] < self.MAX_FREQ:
            l.freq[slot] += 1

    def touch_many(self, slots: "Sequence[int] | np.ndarray") -> None:
        """:meth:`touch` of each of ``slots`` (a slot twice counts twice), as one array update."""
        l = self._l
        n = len(l.queue)
        if not n:
            return
        at = np.asarray(slots, dtype=np.int64)
        at = at[at < n]
        queue = np.frombuffer(l.queue, dtype=np.int8)
        at = at[queue[at] >= 0]
        if not len(at):
            return
        u, times = np.unique(at, return_counts=True)
        freq = np.frombuffer(l.freq, dtype=np.uint8)
        freq[u] = np.minimum(freq[u].astype(np.int64) + times, self.MAX_FREQ)

    def remove(self, slot: int) -> None:
        self._l.unlink(slot)

    def remember(self, key_hash: int) -> None:
        """Record an evicted key's hash in the ghost FIFO (bounded by the main queue's length)."""
        self.remember_many((key_hash,))

    def remember_many(self, key_hashes: Iterable[int]) -> None:
        """:meth:`remember` of each, in order."""
        g = self._ghost
        limit = max(self._l.count[_MAIN], 1024)
        for h in key_hashes:
            g[h] = None
            while len(g) > limit:  # the main queue may have shrunk since the last one: down to its bound
                g.popitem(last=False)

    def take(self, need: int, units: Sequence[int], pinned: Callable[[int], bool]) -> list[int]:
        """:meth:`victim` and :meth:`remove` of each until the victims' ``units[slot]`` sum to ``need`` or more
        (fewer when :meth:`victim` finds none)."""
        out: list[int] = []
        got = 0
        while got < need:
            s = self.victim(pinned)
            if s is None:
                break
            self._l.unlink(s)
            out.append(s)
            got += units[s]
        return out

    def victim(self, pinned: Callable[[int], bool]) -> int | None:
        l = self._l
        budget = 2 * (l.count[_SMALL] + l.count[_MAIN]) + 2 * self.MAX_FREQ * l.count[_MAIN] + 1
        for _ in range(budget):
            total = l.bytes[_SMALL] + l.bytes[_MAIN]
            if l.count[_SMALL] and (l.bytes[_SMALL] >= total * self.SMALL_FRACTION or not l.count[_MAIN]):
                s = l.tail[_SMALL]
                if l.freq[s] > 0 or pinned(s):
                    l.unlink(s)
                    l.push_head(_MAIN, s, l.size[s])
                    l.freq[s] = 0
                    continue
                return s
            if not l.count[_MAIN]:
                return None
            s = l.tail[_MAIN]
            if pinned(s) or l.freq[s] > 0:
                l.unlink(s)
                if l.freq[s] > 0:
                    l.freq[s] -= 1
                l.push_head(_MAIN, s, l.size[s])
                continue
            return s
        return None

    def __len__(self) -> int:
        return self._l.count[_SMALL] + self._l.count[_MAIN]


def make_policy(name: str) -> LruPolicy | S3FifoPolicy:
    if name == "lru":
        return LruPolicy()
    if name in ("s3fifo", "s3-fifo"):
        return S3FifoPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; expected lru or s3fifo")
