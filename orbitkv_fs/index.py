"""The DRAM object index: packed key -> slot, with per-slot columns and per-chunk presence counts.

Sized for millions of segments (target: <= 256 bytes a segment with the eviction policy, also at one
segment per chunk). Objects are grouped by chunk: the packed :class:`~orbitkv_fs.keys.ObjectKey` is
(namespace + chunk: 32 bytes, layer, role), and only the 32-byte prefix is a Python object, one per chunk,
shared by two dicts:

* ``chunks``: prefix -> segments published (a lookup is one dict probe per chunk, not one per layer);
* ``_segs``: prefix -> the chunk's segments: the slot itself while the chunk has one segment, else an
  ``array('i')`` ``[base, slot or -1, ...]`` indexed by ``sub - base``, where ``sub = layer * 3 + role``
  (kept trimmed: its first and last entries are present). Chunks hold the consecutive layers of a pipeline
  stage, so the array is dense; its worst case (two layers 65535 apart) is 768 KiB for that chunk.

A slot is a row of ``array`` columns (extent, lengths, generation, lease count, representation, state,
layer, role) plus a reference to its chunk's prefix; there is no per-segment key object or dict entry.
:attr:`ObjectIndex.keys` rebuilds a slot's packed key on demand (eviction, listings).

Primitives: :meth:`ObjectIndex.add`, :meth:`~ObjectIndex.add_many` (a save batch: a chunk new to the index
placed in one step, columns written per batch; otherwise :meth:`~ObjectIndex.add`'s path, with the same
slots and generations), :meth:`~ObjectIndex.get`, :meth:`~ObjectIndex.get_many`,
:meth:`~ObjectIndex.lease_slots` (a batch's leases: counts up, rows read, in one pass), :meth:`~ObjectIndex.hide`,
:meth:`~ObjectIndex.hide_many` (an eviction's victims: whole chunks in one step), :meth:`~ObjectIndex.free`,
:meth:`~ObjectIndex.free_many`, :meth:`~ObjectIndex.chunk_count`, :meth:`~ObjectIndex.slots`,
:meth:`~ObjectIndex.iter_slots` (the same, lazily), :meth:`~ObjectIndex.prefixes` (the chunks'),
:meth:`~ObjectIndex.chunk_slots` (the objects of given chunks, from the chunk's own array),
:meth:`~ObjectIndex.slots_where` (those of the chunks a prefix test picks: one test per chunk),
:meth:`~ObjectIndex.items`, and :func:`put_rows` / :func:`put_columns` (``array`` columns written at many rows).

States: FREE (row unused) -> LIVE (published: findable, counted in its chunk) -> HIDDEN (evicted or
invalidated while leased: not findable nor counted, extent still allocated) -> FREE (once no lease remains).
Invariants: a LIVE or HIDDEN row owns its extent; generations are unique and never reused, so (slot,
generation) names one publication; ``chunks`` and ``_segs`` have the same keys, the same prefix objects, and
``chunks[p]`` is the number of LIVE slots of chunk ``p``. Not thread-safe: the DRAM tier serialises access.
"""

from __future__ import annotations

import struct
from array import array
from collections import deque
from itertools import groupby
from typing import Callable, Iterable, Iterator, Sequence

import numba
import numpy as np

FREE, LIVE, HIDDEN = 0, 1, 2
_KEY_NS_CHUNK = 32  # bytes of the packed key that name (namespace, chunk)
_KEY_SIZE = 36
_TAIL = struct.Struct("<HB1x")  # layer, role, pad: the packed key after the prefix
_ROLES = 3  # Role.OPAQUE, KEY, VALUE: sub = layer * 3 + role is one-to-one
#: get_many looks keys up one by one when its runs of one chunk are shorter than this on average.
_RUN_MIN = 8
#: Rows a scatter writes one at a time; past this numpy's fixed cost is the smaller one.
_SCATTER_LOOP = 48


def _sub_of(key: bytes) -> int:
    """``layer * 3 + role`` of a packed key, or -1 when ``key`` is not one (length, role, padding)."""
    if len(key) != _KEY_SIZE or key[35] or key[34] >= _ROLES:
        return -1
    return (key[32] | key[33] << 8) * _ROLES + key[34]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _scan(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # words: the packed keys as (n, 9) little-endian uint32, the 32-byte prefix then (layer, role, pad)
    n = words.shape[0]
    sub = np.empty(n, np.int64)
    starts = np.empty(n + 1, np.int64)
    m = 0
    for i in range(n):
        tail = words[i, 8]
        role = (tail >> 16) & 255
        sub[i] = -1 if tail >> 24 or role >= _ROLES else np.int64(tail & 0xFFFF) * _ROLES + role
        new = i == 0
        for w in range(8):
            if new:
                break
            new = words[i, w] != words[i - 1, w]
        if new:
            starts[m] = i
            m += 1
    starts[m] = n
    return sub, starts[:m + 1]


def _scan_keys(keys: Sequence[bytes]) -> "tuple[np.ndarray, list[int]] | None":
    """Each of ``keys``' sub (:func:`_sub_of`: -1 for a key of the right length that is not a packed key) and
    the starts of its runs of one (namespace, chunk) prefix, then ``len(keys)``, in one compiled pass over the
    keys joined; None when some key is not 36 bytes long (the caller takes its per-key path)."""
    n = len(keys)
    raw = b"".join(keys)
    if len(raw) != n * _KEY_SIZE or (n and set(map(len, keys)) != {_KEY_SIZE}):
        return None
    sub, starts = _scan(np.frombuffer(raw, dtype="<u4").reshape(n, _KEY_SIZE // 4))
    return sub, starts.tolist()


def tail_subs(tails: Sequence[bytes]) -> np.ndarray:
    """The sub (``layer * 3 + role``) of keys ending in each of ``tails`` (:func:`~orbitkv_fs.keys.key_tails`),
    -1 for a tail no packed key ends in: what :meth:`ObjectIndex.add_many` 's ``runs`` carry per key."""
    return np.array([_sub_of(bytes(_KEY_NS_CHUNK) + t) for t in tails], dtype=np.int64)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` as one array: the one part itself when there is one (a batch's usual single placement)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _step_of(at: np.ndarray) -> int:
    """1 when ``at`` (two rows or more) ascends by one, -1 when it descends by one, else 0: one pass, not a
    difference array and a test per direction."""
    d = at[1] - at[0]
    if d != 1 and d != -1:
        return 0
    for i in range(2, len(at)):
        if at[i] - at[i - 1] != d:
            return 0
    return d


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _run_slots(sub: np.ndarray, bounds: np.ndarray, bases: np.ndarray, lens: np.ndarray, joined: np.ndarray,
               out: np.ndarray) -> None:
    """:meth:`ObjectIndex.get_many` 's gather: the keys ``bounds[r] .. bounds[r + 1]`` are run ``r``, whose chunk
    array (``[base, slot or -1, ...]``, ``lens[r]`` entries, 0 for a run with none) is the next one in ``joined``;
    a key's slot is at ``sub - base + 1`` there, where that lies within the array. ``out`` keeps its -1 elsewhere."""
    at = 0
    for r in range(bases.shape[0]):
        n = lens[r]
        for i in range(bounds[r], bounds[r + 1]):
            w = sub[i] - bases[r] + 1
            if sub[i] >= 0 and 1 <= w < n:
                out[i] = joined[at + w]
        at += n


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _lease_slots(slots: np.ndarray, leases: np.ndarray, units: np.ndarray, generation: np.ndarray,
                 offset: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:meth:`ObjectIndex.lease_slots` in one pass (a slot named twice gets two leases); ``total`` -1 when a slot
    is not a row (checked first: boundscheck is off), with nothing changed."""
    k, rows = slots.shape[0], leases.shape[0]
    gens, offs, lens = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    for i in range(k):
        if not 0 <= slots[i] < rows:
            return gens, offs, lens, -1
    total = 0
    for i in range(k):
        s = slots[i]
        leases[s] += 1
        total += units[s]
        gens[i], offs[i], lens[i] = generation[s], offset[s], length[s]
    return gens, offs, lens, total


def put_rows(col: array, rows: Sequence[int], values: Sequence[int]) -> None:
    """``col[r] = v`` for each row and value (:func:`put_columns` of one column)."""
    put_columns((col,), rows, (values,))


def put_columns(cols: Sequence[array], rows: Sequence[int], values: Sequence[Sequence[int]]) -> None:
    """``cols[i][r] = values[i][j]`` for each column and each row ``r = rows[j]``: slice assignments where
    the rows are consecutive (ascending, or descending as the free list gives back slots freed in order),
    else a loop for a few rows and a numpy scatter for many; the rows' shape is found once for all columns.
    Rows given as an array (a batch's) are written with numpy, each value an array of the rows or a scalar."""
    k = len(rows)
    if not k:
        return
    if isinstance(rows, np.ndarray):
        at = rows.astype(np.intp, copy=False)
        first, last = int(at[0]), int(at[-1])
        step = 1 if k == 1 else _step_of(at)
        if step == 1:
            at = slice(first, first + k)
        elif step == -1:  # slots freed in order, taken back
            at = slice(first, last - 1 if last else None, -1)
        for col, vals in zip(cols, values):
            np.frombuffer(col, dtype=col.typecode)[at] = vals
        return
    first, last = rows[0], rows[k - 1]
    if last - first == k - 1 and (k < 3 or list(rows) == list(range(first, first + k))):
        for col, vals in zip(cols, values):
            col[first:first + k] = array(col.typecode, vals)
    elif first - last == k - 1 and list(rows) == list(range(first, first - k, -1)):
        for col, vals in zip(cols, values):
            col[last:first + 1] = array(col.typecode, vals)[::-1]
    elif k <= _SCATTER_LOOP:
        for col, vals in zip(cols, values):
            for r, v in zip(rows, vals):
                col[r] = v
    else:
        at = np.asarray(rows, dtype=np.intp)
        for col, vals in zip(cols, values):
            np.frombuffer(col, dtype=col.typecode)[at] = np.fromiter(vals, col.typecode, k)


def _live(have: "int | array | tuple") -> Iterable[int]:
    """The slots a chunk's ``_segs`` entry holds: the slot itself, or the array's present entries."""
    if type(have) is int:
        return (have,)
    return [s for s in have[1:] if s >= 0]


class _Keys:
    """``keys[slot]``: the packed key of a LIVE or HIDDEN slot, None for a FREE one."""

    __slots__ = ("_ix",)

    def __init__(self, ix: "ObjectIndex") -> None:
        self._ix = ix

    def __getitem__(self, slot: int) -> bytes | None:
        ix = self._ix
        prefix = ix._prefix[slot]
        return None if prefix is None else prefix + _TAIL.pack(ix.layer[slot], ix.role[slot])

    def __len__(self) -> int:
        return len(self._ix._prefix)


class ObjectIndex:
    def __init__(self) -> None:
        self.chunks: dict[bytes, int] = {}
        self._segs: dict[bytes, int | array] = {}
        self._prefix: list[bytes | None] = []  # slot -> its chunk's prefix object (shared, not a copy)
        self.keys = _Keys(self)
        self.offset = array("I")  # in allocation units
        self.units = array("I")
        self.length = array("I")  # stored segment bytes (header + payload)
        self.logical = array("I")  # source bytes
        self.generation = array("Q")
        self.leases = array("I")
        self.rep = array("B")  # segment Format
        self.state = array("B")
        self.layer = array("H")
        self.role = array("B")
        self._free: array = array("i")
        self._next_gen = 1
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @property
    def prefix(self) -> "list[bytes | None]":
        """``prefix[slot]``: the 32-byte prefix (namespace + chunk) of a LIVE or HIDDEN slot's chunk, None for
        a FREE one (the index's own list: read it, never write it)."""
        return self._prefix

    def chunk_units(self, prefixes: Sequence[bytes]) -> list[int]:
        """Allocation units of the LIVE objects of each chunk named by a prefix (0 for one not present): the
        chunks' slot arrays joined, one gather and one running sum over them."""
        segs = self._segs
        slots = array("i")
        ends = []
        for p in prefixes:
            have = segs.get(p)
            if type(have) is int:
                slots.append(have)
            elif have is not None:
                slots.extend(have[1:])  # its absent entries are -1: counted as 0 below
            ends.append(len(slots))
        at = np.frombuffer(slots, dtype=np.int32) if slots else np.zeros(0, np.int32)
        got = np.where(at >= 0, np.frombuffer(self.units, dtype=np.uint32)[np.maximum(at, 0)], 0)
        run = np.concatenate(([0], np.cumsum(got, dtype=np.int64)))
        ends_at = np.asarray(ends, dtype=np.int64)
        return (run[ends_at] - run[np.concatenate(([0], ends_at[:-1]))]).tolist() if ends else []

    def _sub(self, slot: int) -> int:
        """``layer * 3 + role`` of the object in ``slot`` (see :func:`_sub_of`)."""
        return self.layer[slot] * _ROLES + self.role[slot]

    def add(self, key: bytes, offset: int, units: int, length: int, logical: int, rep: int) -> tuple[int, int] | None:
        """Publish ``key`` at ``offset``; returns ``(slot, generation)``, or None (and changes nothing) when
        ``key`` is LIVE already."""
        sub = _sub_of(key)
        if sub < 0:
            raise ValueError(f"not a packed object key: {key!r}")
        return self._add(key[:_KEY_NS_CHUNK], sub, offset, units, length, logical, rep)

    def add_many(self, keys: Sequence[bytes], offset: Sequence[int], units: Sequence[int], length: Sequence[int],
                 logical: Sequence[int], rep: Sequence[int], *,
                 runs: "tuple[np.ndarray, list[int]] | None" = None) -> np.ndarray:
        """:meth:`add` of each key, in order, at its offset (the other sequences are columns of the same
        rows: lists or arrays), as one batch. Answers each key's slot (int64), -1 for a key LIVE already
        (nothing changed for it: a key twice in ``keys`` is added at its first place). Stops before the first
        malformed key: an answer shorter than ``keys`` means ``keys[len(answer)]`` is not a packed key and
        nothing from it on was added.

        The same slots (free list first, last freed first, then new rows), generations and chunk arrays as
        :meth:`add` one key at a time. The keys are read in one compiled pass (:func:`_scan_keys`: their subs
        and runs of one chunk, not per key); a run of keys of a chunk new to the index, each once (a save
        batch's whole chunks), is placed in one step and its rows written per column as arrays; other keys go
        through :meth:`add`'s own path.

        ``runs``: what that scan answers for ``keys`` (each key's sub, then the starts of its runs of one prefix
        and ``len(keys)``), from a caller that made the keys itself from checked parts (a save batch: its
        chunks' prefixes and the registration's :func:`tail_subs`); the keys are then not read again."""
        if len(keys) == 1:  # a lone publish (a promotion, a fallback)
            sub = _sub_of(keys[0])
            if sub < 0:
                return np.zeros(0, np.int64)
            got = self._add(keys[0][:_KEY_NS_CHUNK], sub, int(offset[0]), int(units[0]), int(length[0]),
                            int(logical[0]), int(rep[0]))
            return np.array([-1 if got is None else got[0]], np.int64)
        scanned = _scan_keys(keys) if runs is None else runs
        if scanned is None:  # a key of another length: scan the keys before it
            n = next(i for i, k in enumerate(keys) if len(k) != _KEY_SIZE)
            scanned = _scan_keys(keys[:n])
            assert scanned is not None
        subs, bounds = scanned
        if len(subs) and int(subs.min()) < 0:  # stop before the first malformed key
            n = int(np.argmax(subs < 0))
            subs, bounds = subs[:n], [b for b in bounds if b < n] + [n]
        n = len(subs)
        if not n:
            return np.zeros(0, np.int64)
        if n < len(keys):
            keys = keys[:n]
        columns = tuple(np.asarray(c[:n] if len(c) > n else c, dtype=np.int64) for c in (offset, units, length,
                                                                                        logical, rep))
        layers, roles = np.divmod(subs, _ROLES)
        parts: list[np.ndarray] = []
        segs_of = self._segs
        # Rows from the free list that the placements took, and their values per column: written once at the
        # end (nothing reads them before: a chunk placed here is an array, so _add never asks such a row its sub).
        reused: tuple[list, ...] = ([],) + tuple([] for _ in self._columns())
        # Consecutive runs of whole chunks new to the index with one layout (a save batch's chunks): placed
        # together by _add_fresh once the layout changes or another kind of run comes.
        # (a dict: ordered, and a chunk twice in a batch is found in it: placed once, then merged)
        fresh: dict[bytes, None] = {}
        pattern = b""  # the layout of the fresh runs: their subs' bytes
        start = 0  # key index of the first fresh run
        rest = (layers, roles) + columns

        def place_fresh() -> None:
            parts.append(self._add_fresh(reused, list(fresh), subs[start:start + len(pattern) // 8], start, *rest))
            fresh.clear()

        for i, j in zip(bounds[:-1], bounds[1:]):
            k = j - i
            prefix = keys[i][:_KEY_NS_CHUNK]
            sub = subs[i:j]
            have = segs_of.get(prefix)
            if k > 1 and have is None and prefix not in fresh:
                layout = sub.tobytes()
                if layout == pattern or len(set(sub.tolist())) == k:
                    if fresh and layout != pattern:
                        place_fresh()
                    if not fresh:
                        pattern, start = layout, i
                    fresh[prefix] = None
                    continue
            if fresh:
                place_fresh()
                have = segs_of.get(prefix)
            if k > 1 and len(set(sub.tolist())) == k and self._absent(have, sub.tolist()):
                parts.append(self._add_chunk(reused, prefix, sub, *(c[i:j] for c in rest)))
            else:
                got = [self._add(prefix, s, *row) for s, *row in zip(sub.tolist(), *(c[i:j].tolist() for c in columns))]
                parts.append(np.array([-1 if g is None else g[0] for g in got], np.int64))
        if fresh:
            place_fresh()
        if reused[0]:
            put_columns(self._columns() + (self.leases, self.state), _joined(reused[0]),
                        [_joined(v) for v in reused[1:]] + [0, LIVE])
        return _joined(parts)

    def _columns(self) -> tuple[array, ...]:
        """The columns :meth:`_place` writes, in its order."""
        return (self.offset, self.units, self.length, self.logical, self.rep, self.generation, self.layer, self.role)

    def _add(self, prefix: bytes, sub: int, offset: int, units: int, length: int, logical: int,
             rep: int) -> tuple[int, int] | None:
        """:meth:`add` of the key ``prefix`` + the tail of ``sub``."""
        have = self._segs.get(prefix)
        if have is not None:  # the presence test of get(), on the lookup add needs anyway
            if type(have) is int:
                if sub == self._sub(have):
                    return None
            elif 0 <= sub - have[0] < len(have) - 1 and have[1 + sub - have[0]] >= 0:
                return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._prefix)
            self._prefix.append(None)
            for col in (self.offset, self.units, self.length, self.logical, self.generation, self.leases):
                col.append(0)
            for col in (self.rep, self.state, self.layer, self.role):
                col.append(0)
        if have is None:
            self._segs[prefix] = slot
            self.chunks[prefix] = 1
        elif type(have) is int:
            prefix = self._prefix[have]
            other = self._sub(have)  # not sub: the presence test above returned for that
            base = min(other, sub)
            segs = array("i", [-1]) * (abs(other - sub) + 2)
            segs[0], segs[1 + other - base], segs[1 + sub - base] = base, have, slot
            self._segs[prefix] = segs
            self.chunks[prefix] = 2
        else:
            prefix = self._prefix[have[1]]
            i = sub - have[0]
            if i < 0:
                have[1:1] = array("i", [-1]) * -i
                have[0] = sub
                i = 0
            elif i + 1 >= len(have):
                have.extend(array("i", [-1]) * (i + 2 - len(have)))
            have[1 + i] = slot  # a hole: the presence test above returned for a present key
            self.chunks[prefix] += 1
        gen = self._next_gen
        self._next_gen += 1
        self._prefix[slot] = prefix
        self.offset[slot], self.units[slot], self.length[slot] = offset, units, length
        self.logical[slot], self.generation[slot], self.leases[slot] = logical, gen, 0
        self.rep[slot], self.state[slot] = rep, LIVE
        self.layer[slot], self.role[slot] = divmod(sub, _ROLES)
        self._live += 1
        return slot, gen

    def _absent(self, have: "int | array | None", subs: list[int]) -> bool:
        """None of ``subs`` is in the chunk whose entry in ``_segs`` is ``have`` (None: a chunk not there)."""
        if have is None:
            return True
        if type(have) is int:
            return self._sub(have) not in subs
        base, n = have[0], len(have) - 1
        return all(not 0 <= b - base < n or have[1 + b - base] < 0 for b in subs)

    def _take(self, n: int) -> tuple[np.ndarray, int]:
        """The slots ``n`` adds take, in order (int64): the free list's last first, then new rows; and how
        many of them came from the free list (removed from it here)."""
        free = self._free
        take = min(n, len(free))
        rows = len(self._prefix)
        slots = np.empty(n, dtype=np.int64)
        if take:
            slots[:take] = np.frombuffer(free, dtype=np.int32)[len(free) - take:][::-1]  # what n pops give
            del free[len(free) - take:]
        slots[take:] = np.arange(rows, rows + n - take)
        return slots, take

    def _place(self, reused: tuple[list, ...], slots: np.ndarray, take: int, prefixes: list[bytes],
               columns: Sequence[np.ndarray]) -> None:
        """Write ``slots`` (the first ``take`` from the free list, the rest new rows, as :meth:`_take`
        gives them), their prefix objects ``prefixes`` (one per slot) and ``columns`` (:meth:`_columns`'
        order, without generation, layer, role: those follow; arrays): new rows appended here, free-list
        rows to ``reused`` for the caller to write."""
        k = len(slots)
        gen = self._next_gen
        self._next_gen += k
        values = tuple(columns[:5]) + (np.arange(gen, gen + k, dtype=np.int64),) + tuple(columns[5:])
        if take:
            first, last = int(slots[0]), int(slots[take - 1])
            step = -1 if take == 1 else _step_of(slots[:take])
            if step == -1:  # slots freed in order
                self._prefix[last:first + 1] = prefixes[take - 1::-1]
            elif step == 1:  # ... in reverse (freed from such a placement)
                self._prefix[first:last + 1] = prefixes[:take]
            else:  # one C-level pass, not a Python statement per slot
                deque(map(self._prefix.__setitem__, slots[:take].tolist(), prefixes), maxlen=0)
            reused[0].append(slots[:take])
            for acc, vals in zip(reused[1:], values):
                acc.append(vals[:take])
        if take < k:
            self._prefix += prefixes[take:] if take else prefixes
            for col, vals in zip(self._columns(), values):
                col.frombytes(vals[take:].astype(col.typecode).tobytes())
            self.leases.frombytes(bytes(self.leases.itemsize * (k - take)))
            self.state.frombytes(bytes((LIVE,)) * (k - take))
        self._live += k

    def _add_fresh(self, reused: tuple[list, ...], prefixes: list[bytes], subs: np.ndarray, first: int,
                   layers: np.ndarray, roles: np.ndarray, *columns: np.ndarray) -> np.ndarray:
        """Add whole chunks new to the index, ``prefixes`` (distinct), each with the ``k > 1`` distinct
        ``subs``: the keys ``first .. first + len(prefixes) * k`` of ``layers``, ``roles`` and ``columns``
        (offset, units, length, logical, rep). :meth:`_add_chunk` of each in turn, in one step: one chunk
        array built per chunk from a template, the rows written per column for all. Answers the slots."""
        k, c = len(subs), len(prefixes)
        n = k * c
        last = first + n
        slots, take = self._take(n)
        base = int(subs.min())
        width = int(subs.max()) - base + 2
        grid = np.full((c, width), -1, dtype=np.int32)
        grid[:, 0] = base
        grid[:, subs - (base - 1)] = slots.reshape(c, k)
        raw = grid.tobytes()
        step = 4 * width
        segs_of = self._segs
        for x, p in enumerate(prefixes):
            a = array("i")
            a.frombytes(raw[x * step:(x + 1) * step])
            segs_of[p] = a
        self.chunks.update(dict.fromkeys(prefixes, k))
        per_slot: list[bytes] = []
        for p in prefixes:  # each prefix k times: a list repeat per chunk, not a step per slot
            per_slot += [p] * k
        self._place(reused, slots, take, per_slot,
                    [col[first:last] for col in columns] + [layers[first:last], roles[first:last]])
        return slots

    def _add_chunk(self, reused: tuple[list, ...], prefix: bytes, subs: np.ndarray, layers: np.ndarray,
                   roles: np.ndarray, *columns: np.ndarray) -> np.ndarray:
        """Add the ``k > 1`` distinct ``subs`` of chunk ``prefix``, none of them in the index (the chunk may
        hold others: the rest of a chunk that a batch boundary split), with rows of ``columns`` (offset,
        units, length, logical, rep): :meth:`_add` of each, in one step, to the same chunk array. Answers
        the slots (rows as :meth:`_place` writes them)."""
        k = len(subs)
        slots, take = self._take(k)
        have = self._segs.get(prefix)
        old: list[tuple[int, int]] = []  # (sub, slot) of the chunk's segments present
        if have is not None:  # its prefix object is the chunk's, shared as _add shares it
            if type(have) is int:
                old, prefix = [(self._sub(have), have)], self._prefix[have]
            else:
                old = [(have[0] + i, s) for i, s in enumerate(have[1:]) if s >= 0]
                prefix = self._prefix[have[1]]
        lo, hi = int(subs.min()), int(subs.max())
        base = min(lo, old[0][0]) if old else lo
        top = max(hi, old[-1][0]) if old else hi
        segs = array("i", [-1]) * (top - base + 2)
        segs[0] = base
        for b, s in old:
            segs[1 + b - base] = s
        for b, s in zip(subs.tolist(), slots.tolist()):
            segs[1 + b - base] = s
        self._segs[prefix] = segs
        self.chunks[prefix] = k + len(old)
        self._place(reused, slots, take, [prefix] * k, list(columns) + [layers, roles])
        return slots

    def get(self, key: bytes) -> int | None:
        """Slot of the LIVE object ``key``, or None."""
        have = self._segs.get(key[:_KEY_NS_CHUNK])
        if have is None:
            return None
        sub = _sub_of(key)
        if type(have) is int:
            return have if sub == self._sub(have) else None
        i = sub - have[0] + 1
        if sub < 0 or i < 1 or i >= len(have):
            return None
        slot = have[i]
        return slot if slot >= 0 else None

    def lease_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """One more lease on each of ``slots`` (int64 rows; a slot named twice gets two), and their generations,
        offsets (units) and stored lengths, in order (int64 copies, not views: a column may grow and move), and
        their units summed; one compiled pass. IndexError for a slot that is not a row, with nothing changed."""
        slots = np.asarray(slots, dtype=np.int64)
        cols = (np.frombuffer(c, dtype=np.dtype(c.typecode)) for c in (self.leases, self.units, self.generation,
                                                                       self.offset, self.length))
        gens, offs, lens, total = _lease_slots(slots, *cols)
        if total < 0:
            raise IndexError(f"not rows of the index: {slots[(slots < 0) | (slots >= len(self.leases))].tolist()}")
        return gens, offs, lens, total

    def get_many(self, keys: Sequence[bytes], *, runs: "tuple[np.ndarray, list[int]] | None" = None) -> np.ndarray:
        """:meth:`get` of each of ``keys`` as one int64 array, -1 where absent: one dict probe per run of keys
        of one chunk, the slots of a run gathered from its segment array at once (a restore's keys are
        chunk-major). Runs shorter than :data:`_RUN_MIN` keys are looked up one by one. ``runs``: the keys' scan,
        as :meth:`add_many` takes it, from a caller that made the keys (its runs need not be the longest)."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        scanned = _scan_keys(keys) if runs is None else (runs[0], list(runs[1]))
        if scanned is None:  # a key of another length: the per-key path says what each one is
            out[:] = [-1 if (s := self.get(k)) is None else s for k in keys]
            return out
        sub, starts = scanned
        starts.pop()
        if n < _RUN_MIN * len(starts):
            out[:] = [-1 if (s := self.get(k)) is None else s for k in keys]
            return out
        segs_get = self._segs.get
        # The runs' segment arrays side by side: each key's slot is one gather from them.
        ends = starts[1:] + [n]
        bases, lens, bufs = [], [], []
        for i, j in zip(starts, ends):
            have = segs_get(keys[i][:_KEY_NS_CHUNK])
            if type(have) is int:
                out[i:j][sub[i:j] == self._sub(have)] = have
                have = None
            if have is None:  # nothing to gather for this run (absent, or its one slot set above)
                bases.append(0)
                lens.append(0)
                continue
            bases.append(have[0])
            lens.append(len(have))
            bufs.append(have)
        if bufs:
            _run_slots(sub, np.asarray(starts + [n], dtype=np.int64), np.asarray(bases, dtype=np.int64),
                       np.asarray(lens, dtype=np.int64), np.frombuffer(b"".join(bufs), dtype=np.int32), out)
        return out

    def chunk_count(self, ns_chunk: bytes) -> int:
        """Published segments of (namespace + chunk), 32 bytes."""
        return self.chunks.get(ns_chunk, 0)

    def hide(self, slot: int) -> None:
        """LIVE -> HIDDEN: invisible to new readers, extent kept for the leases still on it."""
        prefix = self._prefix[slot]
        assert prefix is not None and self.state[slot] == LIVE
        n = self.chunks[prefix] - 1
        if not n:
            del self.chunks[prefix], self._segs[prefix]
        else:
            self.chunks[prefix] = n
            segs = self._segs[prefix]
            assert type(segs) is array
            i = 1 + self._sub(slot) - segs[0]
            segs[i] = -1
            if n == 1:  # back to the one-slot form
                self._segs[prefix] = next(s for s in segs[1:] if s >= 0)
            elif i == 1:  # keep the first entry present: drop the leading holes
                j = 2
                while segs[j] < 0:
                    j += 1
                del segs[1:j]
                segs[0] += j - 1
            elif i == len(segs) - 1:  # and the last one
                j = i - 1
                while segs[j] < 0:
                    j -= 1
                del segs[j + 1:]
        self.state[slot] = HIDDEN
        self._live -= 1

    def hide_many(self, slots: Sequence[int]) -> None:
        """:meth:`hide` of each of ``slots`` (distinct, LIVE): a run of them that is all of its chunk's LIVE
        slots (an eviction's victims come chunk by chunk, as a save batch published them) drops the chunk in
        one step; other runs go slot by slot."""
        pre = self._prefix
        whole: list[int] = []
        for prefix, run in groupby(slots, pre.__getitem__):
            run = list(run)
            if self.chunks[prefix] == len(run):
                del self.chunks[prefix], self._segs[prefix]
                whole += run
            else:
                for slot in run:
                    self.hide(slot)
        if whole:
            at = np.asarray(whole, dtype=np.intp)
            state = np.frombuffer(self.state, dtype=np.uint8)
            assert (state[at] == LIVE).all()
            state[at] = HIDDEN
            del state  # a view: the column may grow once it is gone
            self._live -= len(whole)

    def free(self, slot: int) -> None:
        """HIDDEN -> FREE (the caller frees the extent)."""
        assert self.state[slot] == HIDDEN and self.leases[slot] == 0
        self._prefix[slot] = None
        self.state[slot] = FREE
        self._free.append(slot)

    def free_many(self, slots: Sequence[int]) -> None:
        """:meth:`free` of each of ``slots``, in order (the free list gives the last one back first)."""
        at = np.asarray(slots, dtype=np.intp)
        assert (np.frombuffer(self.state, dtype=np.uint8)[at] == HIDDEN).all()
        assert not np.frombuffer(self.leases, dtype=np.uint32)[at].any()
        pre = self._prefix
        for slot in slots:
            pre[slot] = None
        put_rows(self.state, slots, [FREE] * len(slots))
        self._free.extend(slots)

    def slots(self) -> Iterator[int]:
        """Slots of the LIVE objects, chunk by chunk (snapshot; safe to hide while iterating)."""
        return iter(list(self.iter_slots()))

    def iter_slots(self) -> Iterator[int]:
        """Slots of the LIVE objects, chunk by chunk, as they are reached: the index must not change until the
        iteration ends (a caller that drops what it found does so after; :meth:`slots` is the snapshot)."""
        for have in self._segs.values():
            yield from _live(have)

    def prefixes(self) -> Iterable[bytes]:
        """The 32-byte prefixes (namespace + chunk) of the chunks with LIVE objects (a live view)."""
        return self._segs.keys()

    def chunk_slots(self, prefixes: Iterable[bytes]) -> list[int]:
        """Slots of the LIVE objects of the chunks named by their 32-byte prefixes (namespace + chunk; one
        not present, or not a prefix, names none)."""
        segs = self._segs
        return [s for p in prefixes for s in _live(segs.get(p, ()))]

    def slots_where(self, match: Callable[[bytes], bool]) -> list[int]:
        """Slots of the LIVE objects of every chunk whose 32-byte prefix ``match``es (snapshot)."""
        return [s for p, have in self._segs.items() if match(p) for s in _live(have)]

    def items(self) -> Iterator[tuple[bytes, int]]:
        """``(packed key, slot)`` of the LIVE objects (snapshot, like :meth:`slots`)."""
        keys = self.keys
        return iter([(keys[s], s) for s in self.slots()])  # type: ignore[misc]
