"""The DRAM tier: one shared-memory arena file per Manager, an offset allocator, leases and eviction.

Primitives:

* :class:`Allocator` -- first-fit over 512-byte units with size-class bins and coalescing on free.
* :class:`Arena` -- the file under ``/dev/shm`` (``orbitkv-arena-<pid>-<id>``), mapped once; refused
  (:class:`~orbitkv_fs.shmfiles.ShmSpaceError`) where its directory cannot hold it, its memory allocated at
  once on request;
  pinned with ``cudaHostRegister`` when a GPU is present (cupy imported lazily). Connectors and peers may map the same
  file: an object is the extent ``(offset, length)`` of it, valid while its ``generation`` is leased. Its
  owner holds an exclusive ``flock`` on it for as long as the arena is open.
* :func:`reclaim_stale_arenas` -- unlink the arena files of Managers that were killed before they could
  (SIGKILL, the OOM killer): a tmpfs file holds its memory until it is removed. :class:`DramTier` runs it
  on its directory before it makes its own arena.
* :class:`DramTier` -- reserve -> write -> publish, lease/unlease (a request's keys as arrays:
  :meth:`DramTier.lease_rows` -> :class:`Leased`, :meth:`DramTier.unlease_rows`), hide/invalidate,
  eviction with demotion to the lower tier through a callback. A save batch reserves with
  :meth:`DramTier.reserve_many` and publishes with :meth:`DramTier.publish_many`: one lock round each, the
  index's ``add_many`` and the policy's ``insert_many`` on the batch's columns as arrays, byte accounting per
  batch. Eviction is per batch
  too: the policy's ``take`` names a batch's worth of victims in one walk, and they leave the index
  (``hide_many``, ``free_many``), the counters and the allocator (``free_many``: neighbours merged) as
  array passes.

Invariants (all under :attr:`DramTier.lock`):

* An extent is reserved before anything writes it and published (visible to lookups) only after the
  writer finished; reserved bytes are counted until published or cancelled.
* A leased object (a read in progress: a restore's hold, a peer's lease) is never evicted, freed or
  overwritten: eviction skips it, invalidation hides it and the extent is freed when the last lease goes.
* A lookup's pin (:meth:`DramTier.pin_chunks`) only keeps its chunks for the restore that follows, and all
  pins together keep at most ``pin_share`` of the pool from eviction: a chunk's units are counted when it is
  first pinned (``pin_units``, less what is evicted or invalidated of it since; ``pinned_units`` their sum),
  and while that sum passes the share an eviction's walk takes pinned objects too, the least recent first (a
  restore of a chunk so evicted misses). Otherwise any process that may register an engine could pin the
  whole pool with its own chunks, and every other engine's save would find no room. The walk takes them only
  from namespaces whose pins hold more than an equal part of the share (``ns_pinned``; max-min fair, which
  always covers the excess): one engine pinning more cannot make another's few pins miss.
* A reservation whose eviction found nothing to take evicts no more for the rest of its pieces: under the
  lock nothing can change, and each further walk would pass every leased object again.
* Residency is counted at stored size (header + payload, rounded to 512-byte units).
* ``demote(keys, segments)`` is called once per eviction with the victims' keys and views of their
  extents, while the lock is held and before the extents are freed: the views are valid during the call
  only (the lower tier copies what it keeps, as ``submit_many`` does), and it must not block. It answers
  how many the lower tier took.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import time
from bisect import bisect_right
from itertools import accumulate, compress, repeat
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from ..index import HIDDEN, ObjectIndex
from ..keys import NS_BYTES, ObjectKey, page_of_chunks
from ..mapguard import guard as guard_mapping, unmap
from ..shmfiles import create_owned, reclaim_stale
from .eviction import make_policy

log = logging.getLogger(__name__)

UNIT = 512
#: A pool of at least this many of a batch's units gives a batch short of room a batch's worth of victims.
BATCHES_FOR_WHOLE = 16
#: Seconds between warnings of a lower tier whose demotion raises (evictions go on; each is counted as not
#: demoted, in ``evictions`` - ``demoted``).
_DEMOTE_LOG_INTERVAL = 60.0
#: At most one warning in this many seconds that evictions take pinned chunks.
_PINS_LOG_INTERVAL = 10.0
#: Victims (or their extents) handled one by one up to this many: below it the array passes cost more than
#: they save (about 40 us a call).
_DROP_LOOP = 16


class Leased(NamedTuple):
    """What :meth:`DramTier.lease_rows` leased: ``hit[i]`` whether ``keys[i]`` was found; for the keys found,
    in key order, their slots, generations, arena offsets and stored lengths (int64 arrays)."""

    hit: np.ndarray
    slots: np.ndarray
    gens: np.ndarray
    offs: np.ndarray
    lens: np.ndarray

    @classmethod
    def none(cls, n: int) -> "Leased":
        empty = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(n, dtype=bool), empty, empty, empty, empty)


def units_of(nbytes: int) -> int:
    return -(-nbytes // UNIT)


class Allocator:
    """Extents of ``total`` units. ``alloc`` is O(bins) amortised; ``free`` coalesces neighbours."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._bins: list[set[int]] = [set() for _ in range(max(total, 1).bit_length() + 1)]
        if total:
            self._insert(0, total)

    def _insert(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._bins[n.bit_length() - 1].add(start)

    def _remove(self, start: int) -> int:
        n = self._by_start.pop(start)
        del self._by_end[start + n]
        self._bins[n.bit_length() - 1].discard(start)
        return n

    def alloc(self, n: int) -> int | None:
        """Start unit of a free extent of ``n`` units, or None."""
        if n <= 0 or n > self.total - self.used:
            return None
        c = n.bit_length() - 1
        start = None
        for s in self._bins[c]:  # same class: sizes in [2**c, 2**(c+1)), may be too small
            if self._by_start[s] >= n:
                start = s
                break
        if start is None:
            for b in self._bins[c + 1:]:
                if b:
                    start = next(iter(b))
                    break
        if start is None:
            return None
        have = self._remove(start)
        if have > n:
            self._insert(start + n, have - n)
        self.used += n
        return start

    def free(self, start: int, n: int) -> None:
        self.used -= n
        end = start + n
        before = self._by_end.get(start)
        if before is not None:
            start = before
            n += self._remove(before)
        if end in self._by_start:
            n += self._remove(end)
        self._insert(start, n)

    def free_many(self, starts: np.ndarray, units: np.ndarray) -> None:
        """:meth:`free` of each extent (``starts[i]``, ``units[i]``), disjoint and allocated: neighbours among
        them (an eviction's victims of one save batch lie side by side) merged first, one :meth:`free` a run."""
        if len(starts) <= _DROP_LOOP:
            for a, n in zip(starts.tolist(), units.tolist()):
                self.free(a, n)
            return
        order = np.argsort(starts, kind="stable")
        s = starts[order].astype(np.int64)
        e = s + units[order]
        cut = np.flatnonzero(e[:-1] != s[1:]) + 1
        for a, b in zip(s[np.r_[0, cut]].tolist(), e[np.r_[cut - 1, len(s) - 1]].tolist()):
            self.free(a, b - a)

    @property
    def free_units(self) -> int:
        return self.total - self.used

    def largest_free(self) -> int:
        """Units of the largest free extent: the top bin's largest (a bin holds sizes within 2x)."""
        for b in reversed(self._bins):
            if b:
                return max(map(self._by_start.__getitem__, b))
        return 0


class Arena:
    """The shared-memory file and its one mapping.

    Its memory must fit its directory: a tmpfs file is sparse, and a write past what the tmpfs has left kills
    the writing process with SIGBUS (a container's /dev/shm is 64 MiB unless sized), so a pool its directory
    cannot hold is refused at start (:class:`~orbitkv_fs.shmfiles.ShmSpaceError`). With ``reserve`` the file's memory is allocated
    at once (``posix_fallocate``: the pool is the Manager's from the start, whoever else fills the tmpfs
    later, and its first writes map pages that exist: on a 2-core VM a 47 MB copy into a fresh file took
    15 ms against 29 ms faulting new pages in, for 0.26 s a GiB at start:
    docs/results/2026-12-05-arena-reserve); without it the directory's free space is checked against the pool
    and pages come with the first writes. Any local user may fill a world-writable ``/dev/shm`` after that
    check, so an arena not reserved is guarded (:mod:`orbitkv_fs.mapguard`): a write the directory cannot back
    gets a private page of the Manager's memory instead of SIGBUS (:attr:`private_bytes` counts them).
    """

    def __init__(self, size: int, *, shm_dir: str = "/dev/shm", pin: bool = True, reserve: bool = False) -> None:
        if size < UNIT:
            raise ValueError(f"pool size {size} is smaller than one {UNIT}-byte unit")
        size = units_of(size) * UNIT
        directory = arena_dir(shm_dir)
        self.path, fd = create_owned(directory, ARENA_PREFIX, size, reserve=reserve, what="the DRAM pool",
                                     hint="lower --pool-size", hex_digits=8)
        try:
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            os.close(fd)
            raise
        self._fd = fd
        self.size = size
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.base_address = int(self.buf.ctypes.data)
        self.guard = None if reserve else guard_mapping(self.base_address, size)
        self.pinned = pin and _host_register(self.base_address, size)

    @property
    def private_bytes(self) -> int:
        """Bytes of the arena its directory could not back (written after the tmpfs filled up): private memory
        of the Manager since, instead of the file's."""
        return 0 if self.guard is None else self.guard.faults * mmap.PAGESIZE

    def close(self) -> None:
        if self.pinned:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.base_address)
            self.pinned = False
        self.buf = None  # type: ignore[assignment]
        unmap(self._mm, self.guard)  # a caller may still hold a view: the mapping (and its guard) goes with it
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with it, after the file
            self._fd = -1


ARENA_PREFIX = "orbitkv-arena-"


def arena_dir(shm_dir: str) -> str:
    """Where arenas of ``shm_dir`` live: it, or /tmp where it does not exist (no /dev/shm)."""
    return shm_dir if os.path.isdir(shm_dir) else "/tmp"


def reclaim_stale_arenas(shm_dir: str = "/dev/shm") -> tuple[int, int]:
    """Unlink the arena files in ``shm_dir`` whose Manager is gone; answers (files, bytes) reclaimed.

    A file is stale when its exclusive flock can be taken (a live arena's owner holds it) and the pid in
    its name is not a live process here (an arena made before the lock existed). Either test alone keeps a
    live arena: a Manager in another PID namespace sharing the directory holds its lock, and one of an
    older version is a live pid. Other files are never touched (:func:`~orbitkv_fs.shmfiles.reclaim_stale`)."""
    return reclaim_stale(arena_dir(shm_dir), ARENA_PREFIX, hex_digits=8, dead_pid_only=True)


def _host_register(address: int, size: int) -> bool:
    """cudaHostRegister the arena once; False where no GPU (or no cupy) is present."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        cupy.cuda.runtime.hostRegister(address, size, 0)
        return True
    except Exception:  # no cupy, no driver, no device: the arena stays pageable host memory
        return False


Demote = Callable[[list[ObjectKey], list[memoryview]], int]


class DramTier:
    def __init__(self, size: int, *, shm_dir: str = "/dev/shm", policy: str = "lru", pin: bool = True,
                 demote: Demote | None = None, reserve: bool = False, pin_share: float = 0.5) -> None:
        if not 0.0 <= pin_share <= 1.0:
            raise ValueError(f"pin_share must be within [0, 1], not {pin_share}")
        self.policy = make_policy(policy)
        #: (files, bytes) of dead Managers' arenas this tier removed from its directory when it started.
        self.reclaimed = reclaim_stale_arenas(shm_dir)
        self.arena = Arena(size, shm_dir=shm_dir, pin=pin, reserve=reserve)
        self.alloc = Allocator(self.arena.size // UNIT)
        #: Units of lookup-pinned objects that eviction leaves alone; past it, it takes pinned ones too.
        self.pin_allowance = int(pin_share * self.alloc.total)
        self.pins_evicted = 0  # objects evicted although a lookup's lease pinned their chunk
        self.index = ObjectIndex()
        self.lock = threading.Lock()
        self.demote = demote
        self.reserved_bytes = 0
        # namespace + chunk -> lookup leases pinning it; a Counter: update() counts a list at C speed.
        self.chunk_pins: collections.Counter[bytes] = collections.Counter()
        # Units of each pinned chunk's objects when it was pinned (less those evicted or invalidated since),
        # and their sum: what the pins hold against eviction.
        self.pin_units: dict[bytes, int] = {}
        self.pinned_units = 0
        self.ns_pinned: collections.Counter[bytes] = collections.Counter()  # pin_units by namespace
        self.leases_active = 0  # lease references held on objects
        self.leased_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.demoted = 0
        self._demote_failed_logged = -_DEMOTE_LOG_INTERVAL
        self._pins_logged = -_PINS_LOG_INTERVAL
        self.resident_bytes: dict[int, int] = {}  # representation -> stored bytes (unit-rounded)
        self.resident_logical = 0
        # Objects a speculative prefetch published that nobody has been served yet: the first lease or
        # read of one counts a prefetch hit, its removal before that a wasted prefetch.
        self.prefetched: set[int] = set()
        self.prefetch_hits = 0
        self.prefetch_wasted = 0

    @property
    def capacity(self) -> int:
        return self.arena.size

    @property
    def used_bytes(self) -> int:
        return self.alloc.used * UNIT

    def view(self, offset: int, length: int) -> np.ndarray:
        """uint8 view of the arena bytes ``[offset, offset + length)``."""
        return self.arena.buf[offset:offset + length]

    # -- reserve / publish ---------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> int | None:
        """Byte offset of a fresh extent of ``nbytes``, evicting unleased objects as needed; None when
        leased objects leave no room."""
        n = units_of(nbytes)
        with self.lock:
            return self._reserve_one(n)

    def _reserve_one(self, n: int) -> int | None:
        alloc = self.alloc
        whole = n * BATCHES_FOR_WHOLE <= alloc.total  # an extent of many segments (a GPU batch's region)
        while True:
            start = alloc.alloc(n)
            if start is not None:
                self.reserved_bytes += n * UNIT
                return start * UNIT
            # First, in a pool of many such extents, n units of the oldest objects (as reserve_many: the
            # oldest batch's room); then what the largest free extent lacks, at least one victim, until
            # one holds n.
            need = n if whole else max(n - alloc.largest_free(), 1)
            whole = False
            if not self._evict(need):
                return None

    def reserve_many(self, sizes: Sequence[int]) -> list[int | None]:
        """:meth:`reserve` of each of ``sizes`` under one lock round (a save batch's segments): the pieces
        carved in order from one extent where one holds them all (after evicting in one step what the free
        room lacks, or a batch's worth in a pool of many batches), else from as few free extents as hold
        them (each piece is an extent of its own from then on: published, cancelled and freed alone),
        evicting again where no free extent holds the next piece; None for each size that found no room."""
        same = len(sizes) > 0 and sizes.count(sizes[0]) == len(sizes)  # a batch of one segment size: no per-size work
        units = [units_of(sizes[0])] * len(sizes) if same else [units_of(n) for n in sizes]
        with self.lock:
            total = sum(units)
            start = self.alloc.alloc(total)
            short = total - self.alloc.free_units
            if start is None and short > 0:
                # In a pool of many batches, a batch's worth of the oldest objects, not only the units
                # missing: in the steady state of a full tier those are the oldest batch, whose extent is one
                # piece of room for this one. Evicting just the shortfall frees parts of it, scattered (a
                # batch is published chunk by chunk but laid out layer by layer), and every later batch would
                # be carved from more pieces than the one before. What that leaves free beyond the need
                # (less than a batch) is at most 1/BATCHES_FOR_WHOLE of the pool; a smaller pool, where that
                # would cost a chunk that fits exactly, evicts the shortfall only.
                self._evict(total if total * BATCHES_FOR_WHOLE <= self.alloc.total else short)
                start = self.alloc.alloc(total)
            if start is not None:
                self.reserved_bytes += total * UNIT
                return self._pieces(start, units, same)
            return self._carve(units, same)

    @staticmethod
    def _pieces(start: int, units: Sequence[int], same: bool) -> list[int]:
        """Byte offsets of ``units`` laid end to end from unit ``start``."""
        if same:
            return list(range(start * UNIT, (start + len(units) * units[0]) * UNIT, units[0] * UNIT))
        return [x * UNIT for x in accumulate(units[:-1], initial=start)]

    def _carve(self, units: list[int], same: bool) -> list[int | None]:
        """:meth:`reserve_many`'s pieces where no free extent holds them all: runs of consecutive pieces, each
        from the largest free extent then; an eviction where that extent holds not even the next piece."""
        alloc = self.alloc
        cum = list(accumulate(units))
        out: list[int | None] = []
        i, base = 0, 0  # the next piece, the units before it
        evictable = True
        while i < len(units):
            k = bisect_right(cum, base + alloc.largest_free(), lo=i) - i  # how many of the next pieces fit there
            if not k:
                # An eviction that found nothing to take finds nothing for the next piece either (the lock is
                # held): once it failed, only free extents are tried (each would walk every leased object).
                if not evictable or not self._evict(max(units[i] - alloc.free_units, 1)):
                    evictable = False
                    out.append(None)  # no room for this one; a smaller one after it may still fit
                    base = cum[i]
                    i += 1
                continue
            n = cum[i + k - 1] - base
            start = alloc.alloc(n)
            assert start is not None  # the largest extent holds n
            self.reserved_bytes += n * UNIT
            out += self._pieces(start, units[i:i + k], same)
            i += k
            base = cum[i - 1]
        return out

    def cancel(self, offset: int, nbytes: int) -> None:
        n = units_of(nbytes)
        with self.lock:
            self.reserved_bytes -= n * UNIT
            self.alloc.free(offset // UNIT, n)

    def publish(self, key: bytes, offset: int, length: int, logical: int, rep: int, *,
                prefetched: bool = False) -> tuple[int, int] | None:
        """Make the reserved extent at ``offset`` the object ``key``; ``(slot, generation)``. When ``key``
        is already present the reservation is freed and None returned. ``prefetched``: published by a
        speculative prefetch (counted as a hit when first served, as wasted when dropped unserved)."""
        with self.lock:
            added = self._publish(key, offset, length, logical, rep)
            if added is not None and prefetched:
                self.prefetched.add(added[0])
            return added

    def publish_many(self, keys: Sequence[bytes], offsets: Sequence[int], lengths: Sequence[int],
                     logical: Sequence[int], reps: Sequence[int], done: list[bool] | None = None, *,
                     runs: "tuple[np.ndarray, list[int]] | None" = None) -> list[bool]:
        """:meth:`publish` of each key at its offset (the other sequences are columns of the same rows:
        stored length, logical bytes, representation; lists or arrays) under one lock round (a save batch's
        segments); per key, whether it was published (False: present already, reservation freed). With
        ``done``, the answers are appended to it: should this raise part way (a malformed key), the keys
        past ``len(done)`` were not published and are still reserved. ``runs``: the keys' scan, as
        :meth:`~orbitkv_fs.index.ObjectIndex.add_many` takes it from a caller that made the keys."""
        out = [] if done is None else done
        with self.lock:
            slots = self._publish_many(keys, offsets, lengths, logical, reps, runs)
        out += (slots >= 0).tolist()
        if len(slots) < len(keys):
            raise ValueError(f"not a packed object key: {keys[len(slots)]!r}")
        return out

    def _publish_many(self, keys: Sequence[bytes], offsets: Sequence[int], lengths: Sequence[int],
                      logical: Sequence[int], reps: Sequence[int],
                      runs: "tuple[np.ndarray, list[int]] | None" = None) -> np.ndarray:
        """The index's :meth:`~orbitkv_fs.index.ObjectIndex.add_many` of the rows with the tier's
        accounting, the rows as arrays: each row's slot (-1: present already, its extent freed); an answer
        shorter than ``keys`` stops before a malformed key (that row and the ones after it stay reserved)."""
        if len(keys) <= 1:
            if not keys:
                return np.zeros(0, np.int64)
            try:
                added = self._publish(keys[0], int(offsets[0]), int(lengths[0]), int(logical[0]), int(reps[0]))
            except ValueError:
                return np.zeros(0, np.int64)
            return np.array([-1 if added is None else added[0]], np.int64)
        length = np.asarray(lengths, dtype=np.int64)
        units = -(-length // UNIT)
        starts = np.asarray(offsets, dtype=np.int64) // UNIT
        logical, reps = np.asarray(logical, dtype=np.int64), np.asarray(reps, dtype=np.int64)
        slots = self.index.add_many(keys, starts, units, length, logical, reps, runs=runs)
        k = len(slots)
        if k < len(keys):
            keys, units, starts, logical, reps = keys[:k], units[:k], starts[:k], logical[:k], reps[:k]
        self.reserved_bytes -= int(units.sum()) * UNIT
        added = slots
        if k and int(slots.min()) < 0:  # present already: the reservation goes back
            keep = slots >= 0
            for start, n in zip(starts[~keep].tolist(), units[~keep].tolist()):
                self.alloc.free(start, n)
            added, units, logical, reps = slots[keep], units[keep], logical[keep], reps[keep]
            keys = list(compress(keys, keep.tolist()))
        if not len(added):
            return slots
        nbytes = units * UNIT
        self.policy.insert_many(added, nbytes, map(hash, keys))
        resident = self.resident_bytes
        rep = int(reps[0])
        if (reps == rep).all():
            resident[rep] = resident.get(rep, 0) + int(nbytes.sum())
        else:  # representations are small codes (Format): one count per code
            sums = np.bincount(reps, weights=nbytes)
            for rep in np.flatnonzero(sums).tolist():
                resident[rep] = resident.get(rep, 0) + int(sums[rep])
        self.resident_logical += int(logical.sum())
        return slots

    def _publish(self, key: bytes, offset: int, length: int, logical: int, rep: int) -> tuple[int, int] | None:
        """:meth:`_publish_many` of one item (a lone publish: a promotion, a host codec's segment), without
        the batch's set-up; ValueError for a malformed key, with nothing changed."""
        n = units_of(length)
        added = self.index.add(key, offset // UNIT, n, length, logical, rep)
        self.reserved_bytes -= n * UNIT
        if added is None:  # present already
            self.alloc.free(offset // UNIT, n)
            return None
        self.policy.insert(added[0], n * UNIT, hash(key))
        self.resident_bytes[rep] = self.resident_bytes.get(rep, 0) + n * UNIT
        self.resident_logical += logical
        return added

    # -- leases --------------------------------------------------------------------------------------

    def _served(self, slot: int) -> None:
        if slot in self.prefetched:
            self.prefetched.discard(slot)
            self.prefetch_hits += 1

    def lease(self, keys: Sequence[bytes]) -> list[tuple[int, int, int, int] | None]:
        """``(slot, generation, offset, length)`` per key under one new lease reference each, or None
        (:meth:`lease_rows` as one tuple per key)."""
        got = self.lease_rows(keys)
        rows = zip(got.slots.tolist(), got.gens.tolist(), got.offs.tolist(), got.lens.tolist())
        if len(got.slots) == len(keys):
            return list(rows)
        out: list[tuple[int, int, int, int] | None] = [None] * len(keys)
        for i, row in zip(np.flatnonzero(got.hit).tolist(), rows):
            out[i] = row
        return out

    def lease_rows(self, keys: Sequence[bytes], *, runs: "tuple[np.ndarray, list[int]] | None" = None) -> Leased:
        """One new lease reference on each key's object, as arrays (:class:`Leased`: which keys were found,
        and the slots, generations, offsets and lengths of those, in key order). As a batch: the slots found
        at once (:meth:`~orbitkv_fs.index.ObjectIndex.get_many`), the lease counts, prefetch hits and byte
        counters updated per batch, the policy touched in key order (the same state as leasing the keys one
        by one). Drop the references with :meth:`unlease_rows`. ``runs``: the keys' scan
        (:meth:`~orbitkv_fs.index.ObjectIndex.get_many`)."""
        ix = self.index
        with self.lock:
            found = ix.get_many(keys, runs=runs)
            hit = found >= 0
            slots = found[hit]
            if not len(slots):
                return Leased.none(len(keys))
            if self.prefetched:
                served = self.prefetched.intersection(slots.tolist())
                self.prefetched -= served
                self.prefetch_hits += len(served)
            gens, offs, lens, units = ix.lease_slots(slots)
            self.leases_active += len(slots)
            self.leased_bytes += units * UNIT
            self.policy.touch_many(slots)
            offs *= UNIT
            return Leased(hit, slots, gens, offs, lens)

    def unlease(self, entries: Iterable[tuple[int, int]]) -> None:
        """Drop one lease reference on each ``(slot, generation)`` (:meth:`unlease_rows`)."""
        entries = entries if isinstance(entries, list) else list(entries)
        if entries:
            at, gens = np.array(entries, dtype=np.int64).reshape(-1, 2).T
            self.unlease_rows(at, gens)

    def unlease_rows(self, at: np.ndarray, gens: np.ndarray) -> None:
        """Drop one lease reference on each slot of ``at`` (int64), leased at generation ``gens``: as a batch
        (the counters per batch, a slot named twice dropped twice), the hidden slots left without a lease
        freed."""
        if not len(at):
            return
        ix = self.index
        with self.lock:
            # No view of an index column outlives an expression: a column cannot grow while one is held.
            assert (np.frombuffer(ix.generation, dtype=np.uint64)[at] == gens.astype(np.uint64)).all(), \
                "lease accounting broken"
            order = np.sort(at)
            if (order[1:] == order[:-1]).any():
                slots, times = np.unique(at, return_counts=True)
            else:
                slots, times = at, 1
            held = np.frombuffer(ix.leases, dtype=np.uint32)[slots]
            assert (held >= times).all(), "lease accounting broken"
            np.frombuffer(ix.leases, dtype=np.uint32)[slots] = held - times
            self.leases_active -= len(at)
            self.leased_bytes -= int(np.frombuffer(ix.units, dtype=np.uint32)[at].sum(dtype=np.int64)) * UNIT
            drained = slots[held == times]
            if len(drained):
                for slot in drained[np.frombuffer(ix.state, dtype=np.uint8)[drained] == HIDDEN].tolist():
                    self._free_slot(slot)

    def pin_chunks(self, ns_chunks: Sequence[bytes]) -> None:
        """Keep every segment of these chunks (namespace + chunk) from eviction: a lookup's lease. Costs
        one dict entry per chunk, not one lease per segment."""
        with self.lock:
            self._pin(ns_chunks)

    def _pin(self, ns_chunks: Sequence[bytes]) -> None:
        """Add a pin to each chunk; a chunk pinned for the first time has its objects' units counted. Lock held."""
        pins = self.chunk_pins
        fresh = [c for c in ns_chunks if c not in pins]
        pins.update(ns_chunks)
        if fresh:
            fresh = list(dict.fromkeys(fresh))  # a chunk twice in one lookup is counted once
            units = self.index.chunk_units(fresh)
            self.pin_units.update(zip(fresh, units))
            total = sum(units)
            self.pinned_units += total
            ns = fresh[0][:NS_BYTES]
            if all(map(bytes.startswith, fresh, repeat(ns))):  # one engine's lookup: one namespace
                if total:
                    self.ns_pinned[ns] += total
            else:
                for c, n in zip(fresh, units):
                    if n:
                        self.ns_pinned[c[:NS_BYTES]] += n

    def unpin_chunks(self, ns_chunks: Sequence[bytes]) -> None:
        pins = self.chunk_pins
        pop = pins.pop
        with self.lock:
            for c in ns_chunks:
                # Most chunks hold one pin: one dict operation (pop) drops it; KeyError when none is held.
                n = pop(c)
                if n > 1:
                    pins[c] = n - 1
                else:
                    self._unpinned(c[:NS_BYTES], self.pin_units.pop(c))

    def leading_complete(self, ns_chunks: Sequence[bytes], nseg: int, *, pin: bool) -> int:
        """How many leading chunks have all ``nseg`` segments published; with ``pin`` they are pinned
        (one lock round for the whole lookup)."""
        count_of = self.index.chunks.get
        n = 0
        with self.lock:
            for c in ns_chunks:
                if count_of(c, 0) < nseg:
                    break
                n += 1
            if pin and n:
                self._pin(ns_chunks if n == len(ns_chunks) else ns_chunks[:n])
        return n

    def _unpinned(self, ns: bytes, units: int) -> None:
        """``units`` of namespace ``ns`` 's pinned chunks are pinned no more. Lock held."""
        self.pinned_units -= units
        left = self.ns_pinned[ns] - units
        if left > 0:
            self.ns_pinned[ns] = left
        else:
            self.ns_pinned.pop(ns, None)

    def _pinned(self, slot: int) -> bool:
        ix = self.index
        return ix.leases[slot] > 0 or (bool(self.chunk_pins) and ix.prefix[slot] in self.chunk_pins)

    def _pin_walk(self) -> tuple[Callable[[int], bool], bool]:
        """The pinned test of one eviction walk, and whether it may take pinned objects: a leased slot is
        always pinned; a slot of a lookup-pinned chunk is, unless the pins hold more than ``pin_allowance``
        units, and then the walk may take (the first met, the least recent) such slots of the namespaces whose
        pins hold more than an equal part of the allowance, each down to that part, until the pins hold no
        more than the allowance (the namespaces' shares over the part add up to the excess at least)."""
        ix, pins = self.index, self.chunk_pins
        leases, units, prefix = ix.leases, ix.units, ix.prefix
        excess = self.pinned_units - self.pin_allowance
        if excess <= 0 or len(self.ns_pinned) < 2:  # one namespace's part is the whole allowance
            def pinned(slot: int) -> bool:
                nonlocal excess
                if leases[slot] > 0:
                    return True
                if pins and prefix[slot] in pins:
                    if excess > 0:
                        excess -= units[slot]
                        return False
                    return True
                return False

            return pinned, excess > 0
        part = self.pin_allowance // len(self.ns_pinned)
        over = {ns: n - part for ns, n in self.ns_pinned.items() if n > part}

        def fair(slot: int) -> bool:
            nonlocal excess
            if leases[slot] > 0:
                return True
            p = prefix[slot]
            if p in pins:
                if excess > 0:
                    ns = p[:NS_BYTES]
                    left = over.get(ns, 0)
                    if left > 0:
                        n = units[slot]
                        over[ns] = left - n
                        excess -= n
                        return False
                return True
            return False

        return fair, True

    def chunk_count(self, ns_chunk: bytes) -> int:
        with self.lock:
            return self.index.chunk_count(ns_chunk)

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return self.index.get(key) is not None

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        """:meth:`contains` of each key under one lock round."""
        get = self.index.get
        with self.lock:
            return [get(k) is not None for k in keys]

    # -- removal -------------------------------------------------------------------------------------

    def _drop_many(self, slots: list[int], *, linked: bool) -> None:
        """Unpublish ``slots`` (distinct, LIVE; still in the policy's lists when ``linked``): their extents
        freed now, or each when its last lease goes; the counters as array passes."""
        if not slots:
            return
        ix = self.index
        if self.pin_units:  # objects of pinned chunks leave: the pins hold less (an object published after its
            # chunk was pinned was not counted: never below zero)
            counted, units = self.pin_units, ix.units
            by_ns: dict[bytes, int] = {}
            for slot, p in zip(slots, map(ix.prefix.__getitem__, slots)):
                if p in counted:
                    d = min(units[slot], counted[p])
                    if d:
                        counted[p] -= d
                        ns = p[:NS_BYTES]
                        by_ns[ns] = by_ns.get(ns, 0) + d
            for ns, d in by_ns.items():
                self._unpinned(ns, d)
        if self.prefetched:
            wasted = self.prefetched.intersection(slots)
            self.prefetched -= wasted
            self.prefetch_wasted += len(wasted)
        if linked:
            for slot in slots:
                self.policy.remove(slot)
        if len(slots) <= _DROP_LOOP:
            for slot in slots:
                ix.hide(slot)
                n = ix.units[slot] * UNIT
                self.resident_bytes[ix.rep[slot]] -= n
                self.resident_logical -= ix.logical[slot]
                if ix.leases[slot] == 0:
                    self._free_slot(slot)
            return
        ix.hide_many(slots)
        at = np.asarray(slots, dtype=np.intp)
        units = np.frombuffer(ix.units, dtype=np.uint32)[at].astype(np.int64)
        reps = np.frombuffer(ix.rep, dtype=np.uint8)[at]
        resident = self.resident_bytes
        for rep, n in enumerate(np.bincount(reps, weights=units).tolist()):
            if n:
                resident[rep] -= int(n) * UNIT
        self.resident_logical -= int(np.frombuffer(ix.logical, dtype=np.uint32)[at].sum(dtype=np.int64))
        free = np.frombuffer(ix.leases, dtype=np.uint32)[at] == 0
        if free.any():
            if not free.all():
                at, units = at[free], units[free]
            self.alloc.free_many(np.frombuffer(ix.offset, dtype=np.uint32)[at], units)
            ix.free_many(at.tolist())

    def _free_slot(self, slot: int) -> None:
        ix = self.index
        self.alloc.free(ix.offset[slot], ix.units[slot])
        ix.free(slot)

    def _copy_out(self, slot: int) -> bytes:
        ix = self.index
        off = ix.offset[slot] * UNIT
        return self.arena.buf[off:off + ix.length[slot]].tobytes()

    def _evict(self, need: int) -> int:
        """Evict unpinned objects in the policy's order until ``need`` units are evicted or none is left;
        how many were. They are demoted (views of their extents) before they go."""
        ix = self.index
        pinned, over = self._pin_walk()
        slots = self.policy.take(need, ix.units, pinned)
        if not slots:
            return 0
        keys = ix.keys
        if over:  # the pins held more than their share: count what the walk took of pinned chunks
            pins, prefix = self.chunk_pins, ix.prefix
            took = sum(1 for s in slots if prefix[s] in pins)
            self.pins_evicted += took
            now = time.monotonic()
            if took and now - self._pins_logged >= _PINS_LOG_INTERVAL:
                self._pins_logged = now
                log.warning("lookup leases pin %.1f MiB of %.1f MiB of pool (%d chunks), more than their share "
                            "(--max-pinned-share): evicting pinned chunks, least recent first (their restores miss)",
                            self.pinned_units * UNIT / 2**20, self.capacity / 2**20, len(pins))
        if self.demote is not None:
            buf, offset, length = memoryview(self.arena.buf), ix.offset, ix.length
            views = [buf[offset[s] * UNIT:offset[s] * UNIT + length[s]] for s in slots]
            try:
                self.demoted += self.demote([ObjectKey.unpack(keys[s]) for s in slots], views)
            except Exception as e:  # noqa: BLE001 - the victims leave either way: a failing lower tier must
                # not leave them taken from the policy but still in the index (never evicted again)
                now = time.monotonic()
                if now - self._demote_failed_logged >= _DEMOTE_LOG_INTERVAL:
                    self._demote_failed_logged = now
                    log.warning("demoting %d evicted objects to the lower tier failed (dropped): %r", len(slots), e)
        self.policy.remember_many(map(hash, map(keys.__getitem__, slots)))
        self.evictions += len(slots)
        self.evicted_bytes += sum(map(ix.units.__getitem__, slots)) * UNIT
        self._drop_many(slots, linked=False)
        return len(slots)

    def invalidate(self, match_chunk: Callable[[bytes], bool]) -> tuple[int, int]:
        """Unpublish every object of the chunks whose 32-byte prefix (namespace + chunk) ``match_chunk``es:
        one test per chunk, not per object; ``(objects, stored bytes)``."""
        with self.lock:
            return self._invalidate_slots(self.index.slots_where(match_chunk))

    def invalidate_chunks(self, prefixes: Iterable[bytes]) -> tuple[int, int]:
        """:meth:`invalidate` of the chunks named by their 32-byte prefixes, each found in the index, not by
        a scan of every object (which held the lock for 1.7 s at a million objects, per call an engine may
        make for its own chunks)."""
        with self.lock:
            return self._invalidate_slots(self.index.chunk_slots(dict.fromkeys(prefixes)))

    def invalidate_keys(self, keys: Iterable[bytes]) -> tuple[int, int]:
        """Unpublish the objects of these packed keys (absent or malformed ones are none)."""
        with self.lock:
            get = self.index.get
            return self._invalidate_slots([s for s in map(get, dict.fromkeys(keys)) if s is not None])

    def _invalidate_slots(self, slots: list[int]) -> tuple[int, int]:
        """Unpublish ``slots`` (distinct, LIVE); ``(objects, stored bytes)``. Lock held."""
        nbytes = sum(map(self.index.length.__getitem__, slots))
        self._drop_many(slots, linked=True)
        return len(slots), nbytes

    def drain(self, max_bytes: int) -> tuple[list[tuple[ObjectKey, bytes]], int]:
        """Remove unleased objects, up to about ``max_bytes`` of them, and return copies of their bytes;
        also the number of leased (or pinned) objects passed over. An empty list: nothing left to take."""
        out: list[tuple[ObjectKey, bytes]] = []
        slots: list[int] = []
        leased = taken = 0
        with self.lock:
            # Lazily, and a key built only for what is taken: a flush drains a pool slice by slice, and a
            # snapshot of every object's key per slice made a flush quadratic in the objects cached.
            keys = self.index.keys
            for slot in self.index.iter_slots():
                if self._pinned(slot):
                    leased += 1
                    continue
                if taken >= max_bytes:
                    break
                taken += self.index.length[slot]
                out.append((ObjectKey.unpack(keys[slot]), self._copy_out(slot)))
                slots.append(slot)
            self._drop_many(slots, linked=True)
        return out, leased

    def read(self, key: bytes) -> bytes | None:
        """A copy of ``key``'s bytes (unverified), or None."""
        with self.lock:
            slot = self.index.get(key)
            if slot is None:
                return None
            self._served(slot)
            return self._copy_out(slot)

    def listing(self, match_chunk: Callable[[bytes], bool] | None = None, after: bytes = b"",
                limit: int | None = None) -> list[tuple[bytes, int, int, int, int]]:
        """``(packed key, rep, logical, stored length, generation)`` of the objects whose key sorts after
        ``after``, of the chunks whose 32-byte prefix ``match_chunk``es (all without it), sorted by key: the
        first ``limit`` of them (at least; all without it). Chunk by chunk in prefix order, so that a page of
        an admin listing builds the rows of its own chunks, not of every object under the lock."""
        ix = self.index
        keys = ix.keys
        with self.lock:
            return page_of_chunks(ix.prefixes(), lambda p: [(keys[s], ix.rep[s], ix.logical[s], ix.length[s],
                                                             ix.generation[s]) for s in ix.chunk_slots((p,))],
                                  after, limit, match_chunk)

    def close(self) -> None:
        self.arena.close()
