"""ObjectIndex against a plain dict model: random add (also of live keys: refused) / hide / free over a few
chunks, layers and roles, checking get, chunk counts, keys, items and the compact per-chunk forms after
every step; malformed keys; and its memory per segment (the benchmark's target, at a smaller count)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import numpy as np
import pytest

from orbitkv_fs.index import FREE, HIDDEN, LIVE, ObjectIndex, _scan_keys, put_columns, tail_subs
from orbitkv_fs.keys import ObjectKey, chunk_key, key_tails
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.eviction import make_policy

NS = bytes(range(16))


def key(chunk: int, layer: int, role: Role) -> bytes:
    return ObjectKey(NS, chunk_key(chunk), layer, role).pack()


def check(ix: ObjectIndex, live: dict[bytes, int], hidden: set[int]) -> None:
    assert len(ix) == len(live)
    for k, s in live.items():
        assert ix.get(k) == s and ix.keys[s] == k and ix.state[s] == LIVE
    for s in hidden:
        assert ix.state[s] == HIDDEN and ix.get(ix.keys[s]) != s  # the key may be live again elsewhere
    counts: dict[bytes, int] = {}
    for k in live:
        counts[k[:32]] = counts.get(k[:32], 0) + 1
    assert ix.chunks == counts
    assert sorted(ix.items()) == sorted(live.items())
    assert sorted(ix.slots()) == sorted(live.values())
    for p, c in counts.items():
        assert ix.chunk_count(p) == c
        segs = ix._segs[p]
        if c == 1:
            assert isinstance(segs, int)
        else:  # trimmed: both ends present
            assert segs[1] >= 0 and segs[-1] >= 0 and sum(s >= 0 for s in segs[1:]) == c
    # One prefix object per chunk, shared by both dicts and every slot of the chunk.
    objs = {id(p) for p in ix.chunks}
    assert objs == {id(p) for p in ix._segs}
    assert all(id(ix._prefix[s]) in objs for s in live.values())


def test_random_against_a_model():
    rnd = random.Random(7)
    ix = ObjectIndex()
    live: dict[bytes, int] = {}
    hidden: set[int] = set()
    gens: set[int] = set()
    universe = [key(c, layer, r) for c in range(5) for layer in (0, 1, 2, 7, 40) for r in Role]
    for step in range(3000):
        op = rnd.random()
        if op < 0.5:
            k = rnd.choice(universe)
            if k in live:  # adding a live key changes nothing: no slot, no generation, no count
                n, free = len(ix), len(ix._free)
                assert ix.add(k, step, 1, 100, 200, 1) is None
                assert (len(ix), len(ix._free), ix.get(k)) == (n, free, live[k])
                continue
            slot, gen = ix.add(k, step, 1, 100, 200, 1)
            assert gen not in gens and slot not in live.values() and slot not in hidden
            gens.add(gen)
            live[k] = slot
        elif op < 0.85 and live:
            k = rnd.choice(sorted(live))
            s = live.pop(k)
            ix.hide(s)
            hidden.add(s)
        elif hidden:
            s = rnd.choice(sorted(hidden))
            hidden.remove(s)
            ix.free(s)
            assert ix.state[s] == FREE and ix.keys[s] is None
        if step % 50 == 0:
            check(ix, live, hidden)
    check(ix, live, hidden)
    for s in list(live.values()):
        ix.hide(s)
    assert len(ix) == 0 and ix.chunks == {} and ix._segs == {}


def test_prepend_and_holes_in_a_chunk():
    ix = ObjectIndex()
    a = ix.add(key(1, 10, Role.VALUE), 0, 1, 1, 1, 0)[0]
    b = ix.add(key(1, 3, Role.KEY), 0, 1, 1, 1, 0)[0]  # below the base: the array grows at the front
    c = ix.add(key(1, 20, Role.OPAQUE), 0, 1, 1, 1, 0)[0]
    assert [ix.get(key(1, L, r)) for L, r in ((10, Role.VALUE), (3, Role.KEY), (20, Role.OPAQUE))] == [a, b, c]
    assert ix.get(key(1, 10, Role.KEY)) is None and ix.get(key(1, 2, Role.KEY)) is None
    assert ix.get(key(1, 21, Role.KEY)) is None and ix.get(key(2, 10, Role.VALUE)) is None
    ix.hide(b)
    assert ix._segs[key(1, 10, Role.VALUE)[:32]][0] == 10 * 3 + 2
    ix.hide(c)
    assert ix._segs[key(1, 0, Role.KEY)[:32]] == a and ix.get(key(1, 10, Role.VALUE)) == a


@pytest.mark.parametrize("bad", [b"", bytes(35), bytes(37), bytes(35) + b"\x01", bytes(34) + b"\x03\x00"])
def test_malformed_keys_miss_and_are_refused(bad):
    ix = ObjectIndex()
    ix.add(bytes(36), 0, 1, 1, 1, 0)
    assert ix.get(bad) is None
    with pytest.raises(ValueError):
        ix.add(bad, 0, 1, 1, 1, 0)


@pytest.mark.parametrize("per_chunk", [1, 2, 60])
def test_memory_per_segment_with_each_policy(per_chunk):
    n = 60_000
    layers = per_chunk // 2 or 1
    tails = [ObjectKey(NS, bytes(16), s % layers, Role.KEY if s < layers else Role.VALUE).pack()[32:]
             for s in range(per_chunk)]
    for policy in ("lru", "s3fifo"):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        ix = ObjectIndex()
        pol = make_policy(policy)
        for i in range(n):
            kb = NS + (i // per_chunk).to_bytes(16, "little") + tails[i % per_chunk]
            slot, _ = ix.add(kb, i, 2, 1000, 2000, 0)
            pol.insert(slot, 1024, hash(kb))
        used = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
        assert used <= 256, f"{used:.0f} bytes a segment with {policy}"
        del ix, pol


# --- deterministic edges the random model rarely reaches: slot 0 in a chunk's array, layers past 255, the
# exact compact forms, misuse -----------------------------------------------------------------------------

def test_states_are_distinct_and_an_absent_chunk_counts_zero():
    assert len({FREE, LIVE, HIDDEN}) == 3
    ix = ObjectIndex()
    assert ix.chunk_count(key(9, 0, Role.KEY)[:32]) == 0 and len(ix) == 0
    s, gen = ix.add(key(9, 0, Role.KEY), 5, 2, 300, 600, 3)
    assert ix.chunk_count(key(9, 0, Role.KEY)[:32]) == 1 and ix.chunk_count(key(8, 0, Role.KEY)[:32]) == 0
    assert (ix.offset[s], ix.units[s], ix.length[s], ix.logical[s], ix.rep[s], ix.leases[s], ix.state[s]) == \
        (5, 2, 300, 600, 3, 0, LIVE)
    s2, gen2 = ix.add(key(9, 1, Role.KEY), 7, 1, 10, 20, 0)
    assert gen2 > gen and s2 != s


def test_slot_zero_inside_a_chunk_s_array():
    ix = ObjectIndex()
    k0, k1, k2 = key(1, 4, Role.KEY), key(1, 5, Role.VALUE), key(1, 9, Role.OPAQUE)
    assert ix.add(k0, 0, 1, 1, 1, 0)[0] == 0
    s1 = ix.add(k1, 0, 1, 1, 1, 0)[0]
    s2 = ix.add(k2, 0, 1, 1, 1, 0)[0]
    p = k0[:32]
    assert list(ix._segs[p]) == [4 * 3 + 1, 0] + [-1] * 3 + [s1] + [-1] * 9 + [s2]
    assert ix.add(k0, 9, 1, 1, 1, 0) is None and ix.get(k0) == 0 and ix.chunk_count(p) == 3
    assert sorted(ix.slots()) == [0, s1, s2] and dict(ix.items())[k0] == 0
    ix.hide(s1)  # a hole in the middle
    assert list(ix._segs[p]) == [13, 0] + [-1] * 13 + [s2]
    ix.hide(s2)  # back to the one-slot form: slot 0
    assert ix._segs[p] == 0 and ix.get(k0) == 0 and list(ix.slots()) == [0]
    s1 = ix.add(k1, 0, 1, 1, 1, 0)[0]
    k_low = key(1, 2, Role.KEY)
    s3 = ix.add(k_low, 0, 1, 1, 1, 0)[0]  # below the base: the array grows at the front
    assert list(ix._segs[p]) == [7, s3] + [-1] * 5 + [0, -1, -1, -1, s1]
    ix.hide(s3)  # the leading holes go: slot 0 is first again
    assert list(ix._segs[p]) == [13, 0, -1, -1, -1, s1]
    ix.hide(s1)
    assert ix._segs[p] == 0


def test_layers_past_255_round_trip():
    ix = ObjectIndex()
    ks = [key(2, layer, role) for layer in (255, 256, 300, 65535) for role in Role]
    slots = [ix.add(k, 0, 1, 1, 1, 0)[0] for k in ks]
    assert [ix.get(k) for k in ks] == slots and [ix.keys[s] for s in slots] == ks
    assert [(ix.layer[s], ix.role[s]) for s in slots] == [(layer, int(role)) for layer in (255, 256, 300, 65535)
                                                          for role in Role]
    assert sorted(ix.items()) == sorted(zip(ks, slots))


def test_misuse_is_refused():
    ix = ObjectIndex()
    s = ix.add(key(3, 0, Role.KEY), 0, 1, 1, 1, 0)[0]
    with pytest.raises(AssertionError):
        ix.free(s)  # still live
    ix.hide(s)
    with pytest.raises(AssertionError):
        ix.hide(s)  # hidden already
    ix.leases[s] = 1
    with pytest.raises(AssertionError):
        ix.free(s)  # leased
    ix.leases[s] = 0
    ix.free(s)
    assert ix.state[s] == FREE and ix.keys[s] is None
    with pytest.raises(AssertionError):
        ix.hide(s)  # free


def test_trailing_holes_are_trimmed_back_to_slot_zero():
    ix = ObjectIndex()
    k0, ka, kb = key(4, 3, Role.KEY), key(4, 1, Role.KEY), key(4, 6, Role.VALUE)
    assert ix.add(k0, 0, 1, 1, 1, 0)[0] == 0
    a = ix.add(ka, 0, 1, 1, 1, 0)[0]
    b = ix.add(kb, 0, 1, 1, 1, 0)[0]
    p = k0[:32]
    assert list(ix._segs[p]) == [4, a] + [-1] * 5 + [0] + [-1] * 9 + [b]
    ix.hide(b)  # the trailing holes go: slot 0 is last again
    assert list(ix._segs[p]) == [4, a] + [-1] * 5 + [0] and sorted(ix.slots()) == [0, a]


def _state(ix: ObjectIndex) -> tuple:
    """Everything of an index that add and add_many write."""
    cols = (ix.offset, ix.units, ix.length, ix.logical, ix.generation, ix.leases, ix.rep, ix.state, ix.layer, ix.role)
    segs = {p: (v if isinstance(v, int) else list(v)) for p, v in ix._segs.items()}
    return (tuple(list(c) for c in cols), segs, dict(ix.chunks), list(ix._prefix), list(ix._free), ix._next_gen,
            len(ix))


def _caller_runs(keys: list[bytes]) -> tuple[np.ndarray, list[int]]:
    """What a caller that made ``keys`` from prefixes and tails knows of them: each key's sub, from its tail
    (:func:`tail_subs`), and where each run of one prefix starts, then ``len(keys)``."""
    starts = [i for i in range(len(keys)) if not i or keys[i][:32] != keys[i - 1][:32]] + [len(keys)]
    return tail_subs([k[32:] for k in keys]), starts


@pytest.mark.parametrize("scan", ["index", "caller"])
@pytest.mark.parametrize("columns", ["lists", "arrays"])
@pytest.mark.parametrize("layout", ["random", "whole"])
@pytest.mark.parametrize("seed", range(4))
def test_add_many_is_add_one_key_at_a_time(seed, layout, columns, scan, monkeypatch):
    """Random batches (whole new chunks, chunks present in part, keys twice in a batch and keys LIVE
    already, slots freed in between and reused) give the same answers, slots, generations, columns, chunk
    arrays and shared prefix objects as add of each key in order. "whole": most runs are whole chunks of
    one layout (a save batch's), so that runs of new chunks are placed together (and a chunk may come
    twice in a batch, apart). "caller": the keys' subs and runs come from the caller (``runs``, as a save
    batch hands them over), not from the index's scan of the keys."""
    rnd = random.Random(seed)
    one, many = ObjectIndex(), ObjectIndex()
    subs = [(layer, r) for layer in (0, 1, 2, 5, 9, 300) for r in (Role.KEY, Role.VALUE)] + [(7, Role.OPAQUE)]
    together = []
    place = ObjectIndex._add_fresh
    monkeypatch.setattr(ObjectIndex, "_add_fresh", lambda ix, r, prefixes, *a: together.append(len(prefixes))
                        or place(ix, r, prefixes, *a))
    for step in range(120):
        keys: list[bytes] = []
        for _ in range(rnd.randrange(1, 5) if layout == "random" else rnd.randrange(1, 9)):  # runs of one chunk
            c = rnd.randrange(12) if layout == "random" else rnd.randrange(40)
            if layout == "whole" and rnd.random() < 0.85:
                run = list(subs)
            else:
                run = rnd.sample(subs, rnd.randrange(1, len(subs) + 1))
            if rnd.random() < (0.3 if layout == "random" else 0.05):  # a key twice
                run.append(rnd.choice(run))
            keys += [key(c, layer, r) for layer, r in run]
        cols = [[rnd.randrange(1 << 20) for _ in keys] for _ in range(4)] + [[rnd.randrange(4) for _ in keys]]
        want = []
        for i, k in enumerate(keys):
            got = one.add(k, *(c[i] for c in cols))
            want.append(-1 if got is None else got[0])
        given = cols if columns == "lists" else [np.asarray(c, dtype=np.int64) for c in cols]  # as a save batch
        runs = _caller_runs(keys) if scan == "caller" else None
        assert many.add_many(keys, *given, runs=runs).tolist() == want
        assert _state(many) == _state(one)
        # Hide and free some (the same ones in both): the next batch reuses their slots.
        live = sorted(s for s in range(len(one._prefix)) if one.state[s] == LIVE)
        # at times all of them in slot order (an invalidation of everything): the free list then gives back
        # runs of consecutive slots
        everything = rnd.random() < 0.15
        for s in live if everything else rnd.sample(live, len(live) // 3):
            free = everything or rnd.random() < 0.9
            for ix in (one, many):
                ix.hide(s)
                if free:
                    ix.free(s)
        assert _state(many) == _state(one)
        check(many, {k: s for k, s in one.items()}, {s for s in range(len(one._prefix)) if one.state[s] == HIDDEN})
    if layout == "whole":  # the batched placement ran, with several chunks at a time
        assert together and max(together) >= 3


@pytest.mark.parametrize("seed", range(3))
def test_put_columns_writes_every_row_whatever_their_shape(seed):
    """put_columns of rows ascending and consecutive, descending and consecutive (a free list's), a few and
    many scattered, as lists or as an array (values as lists, arrays or one scalar): each column as a row
    by row assignment leaves it; rows outside those keep their values."""
    rnd = random.Random(seed)
    for _ in range(200):
        n = rnd.randrange(1, 300)
        cols = [array("I", range(n)), array("B", [7] * n), array("Q", [1 << 40] * n)]
        k = rnd.randrange(1, n + 1)
        shape = rnd.choice(("up", "down", "scattered"))
        if shape == "up":
            a = rnd.randrange(n - k + 1)
            rows = list(range(a, a + k))
        elif shape == "down":
            a = rnd.randrange(k - 1, n)
            rows = list(range(a, a - k, -1))
        else:
            rows = rnd.sample(range(n), k)
        vals = [[rnd.randrange(1 << 32) for _ in rows], [rnd.randrange(256) for _ in rows], 5]
        want = [list(c) for c in cols]
        for w, v in zip(want, vals):
            for j, r in enumerate(rows):
                w[r] = v if isinstance(v, int) else v[j]
        if rnd.random() < 0.5:
            put_columns(cols, np.asarray(rows, dtype=np.int64), [np.asarray(vals[0]), vals[1], vals[2]])
        else:
            put_columns(cols, rows, [vals[0], vals[1], [5] * k])
        assert [list(c) for c in cols] == want


def test_tail_subs_are_the_subs_the_key_scan_finds():
    """A registration's tails (every layer and role a key can carry, and tails no packed key ends in) give
    the subs the index's own scan reads from whole keys: what lets a save batch hand its keys' scan over."""
    tails = key_tails([(layer, role) for layer in (0, 1, 35, 255, 65535) for role in Role])
    tails += [b"\x00\x00\x03\x00", b"\x01\x00\x01\x07"]  # role 3; pad byte set: not packed keys
    keys = [bytes(NS) + chunk_key(c) + t for c in range(3) for t in tails]
    subs, starts = _scan_keys(keys)
    assert tail_subs(tails).tolist() * 3 == subs.tolist()
    assert tail_subs(tails)[-2:].tolist() == [-1, -1]
    assert _caller_runs(keys)[1] == starts


def test_add_many_stops_before_a_malformed_key():
    one, many = ObjectIndex(), ObjectIndex()
    good = [key(1, layer, Role.KEY) for layer in range(4)]
    for bad in (bytes(35), bytes(34) + b"\x03\x00", bytes(35) + b"\x01"):
        keys = good[:2] + [bad] + good[2:]
        cols = [list(range(len(keys)))] * 5
        got = many.add_many(keys, *cols)
        assert len(got) == 2  # keys[2] is the malformed one; nothing from it on was added
        for i, k in enumerate(keys[:2]):
            one.add(k, *(c[i] for c in cols))
        with pytest.raises(ValueError):
            one.add(bad, 0, 0, 0, 0, 0)
        assert _state(many) == _state(one)
        assert many.get(good[2]) is None and many.add_many([bad], [0], [0], [0], [0], [0]).tolist() == []


@pytest.mark.parametrize("bad", [bytes(35), bytes(37), bytes(34) + b"\x03\x00", bytes(35) + b"\x01"])
def test_add_many_stops_at_a_malformed_key_anywhere_in_a_batch_of_chunks(bad):
    """A save batch of whole chunks (runs the batch step places together) with one key that is not a packed
    key at each place in turn, first and last included: the keys before it are added as add() adds them, one
    at a time, and nothing from it on."""
    good = [key(c, layer, role) for c in range(3) for layer in range(4) for role in (Role.KEY, Role.VALUE)]
    for at in range(len(good) + 1):
        one, many = ObjectIndex(), ObjectIndex()
        keys = good[:at] + [bad] + good[at:]
        cols = [list(range(10, 10 + len(keys)))] * 5
        assert many.add_many(keys, *cols).tolist() == [one.add(k, *(c[i] for c in cols))[0]
                                                      for i, k in enumerate(keys[:at])]
        assert _state(many) == _state(one)


def _index_state(ix: ObjectIndex) -> tuple:
    segs = {p: (s if isinstance(s, int) else list(s)) for p, s in ix._segs.items()}
    return (dict(ix.chunks), segs, list(ix.state), list(ix._prefix), list(ix._free), len(ix))


@pytest.mark.parametrize("seed", range(4))
def test_hide_many_and_free_many_are_hide_and_free_of_each(seed):
    """Batches of slots to hide, as an eviction takes them (whole chunks in publish order, parts of chunks,
    chunks interleaved, a chunk in two runs), leave the same chunk counts, segment arrays (trimmed, back to
    one slot), states and live count as hide of each in order; free_many the same prefixes, states and free
    list (its order: the slots reused next) as free of each."""
    rnd = random.Random(seed)
    one, many = ObjectIndex(), ObjectIndex()
    live: list[int] = []
    for step in range(60):
        keys = [key(c, layer, r) for c in rnd.sample(range(40), 4) for layer in sorted(rnd.sample(range(12), 5))
                for r in (Role.KEY, Role.VALUE)]
        got = [int(one.add_many([k], [0], [1], [1], [1], [0])[0]) for k in keys]
        assert many.add_many(keys, [0] * len(keys), [1] * len(keys), [1] * len(keys), [1] * len(keys),
                             [0] * len(keys)).tolist() == got
        live += [g for g in got if g >= 0]
        shape = rnd.choice(("whole", "part", "shuffled"))
        k = rnd.randrange(1, len(live) + 1)
        batch = live[:k] if shape != "part" else sorted(rnd.sample(live, k))
        if shape == "shuffled":
            rnd.shuffle(batch)
        for s in batch:
            one.hide(s)
        many.hide_many(batch)
        assert _index_state(many) == _index_state(one)
        live = [s for s in live if s not in set(batch)]
        freed = [s for s in batch if rnd.random() < 0.8]
        for s in freed:
            one.free(s)
        many.free_many(freed)
        assert _index_state(many) == _index_state(one)
        for s in batch:
            if s not in freed:
                one.free(s)
                many.free(s)
        check(many, {many.keys[s]: s for s in live}, set())


def test_chunk_units_sum_each_chunks_live_objects():
    """A chunk of one object (its slot held as an int), one of many with a hole (an array with a -1 entry), one
    whose objects are all gone, one never added, the same chunk twice, and no chunk at all."""
    ix = ObjectIndex()
    ix.add(key(1, 0, Role.KEY), 0, 3, 1000, 1000, 0)
    for layer, units in ((0, 2), (1, 5), (2, 7)):
        ix.add(key(2, layer, Role.VALUE), 0, units, 1000, 1000, 0)
    ix.hide(ix.get(key(2, 1, Role.VALUE)))  # evicted: no longer LIVE
    gone = ix.add(key(3, 4, Role.KEY), 0, 9, 1000, 1000, 0)[0]
    ix.hide(gone)
    p = [key(c, 0, Role.KEY)[:32] for c in (1, 2, 3, 4)]
    assert ix.chunk_units(p + [p[1]]) == [3, 9, 0, 0, 9]
    assert ix.chunk_units([]) == []
