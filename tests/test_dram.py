"""DRAM tier: the offset allocator, LRU and S3-FIFO, leases and chunk pins, the arena file."""

from __future__ import annotations

import fcntl
import os
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

from orbitkv_fs.index import FREE, LIVE
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import UNIT, Allocator, DramTier, reclaim_stale_arenas
from orbitkv_fs.tiers.eviction import LruPolicy, S3FifoPolicy, make_policy


def test_allocator_random_alloc_free_coalesces():
    a = Allocator(1000)
    rnd = random.Random(1)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rnd.random() < 0.5:
            s = rnd.choice(list(live))
            a.free(s, live.pop(s))
        else:
            n = rnd.randint(1, 40)
            s = a.alloc(n)
            if s is None:
                continue
            assert 0 <= s and s + n <= 1000
            for t, m in live.items():  # no overlap with any live extent
                assert s + n <= t or t + m <= s
            live[s] = n
        assert a.used == sum(live.values())
    for s, n in list(live.items()):
        a.free(s, n)
    assert a.used == 0 and a.largest_free() == 1000 and a.alloc(1000) == 0


def test_allocator_refuses_what_does_not_fit():
    a = Allocator(10)
    assert a.alloc(11) is None and a.alloc(0) is None
    x, y = a.alloc(5), a.alloc(5)
    assert {x, y} == {0, 5} and a.alloc(1) is None
    a.free(x, 5)
    assert a.alloc(6) is None and a.alloc(5) == x


def test_lru_order_and_pins():
    p = LruPolicy()
    for s in range(5):
        p.insert(s, 512, s)
    p.touch(0)
    assert p.victim(lambda s: False) == 1
    assert p.victim(lambda s: s in (1, 2)) == 3
    p.remove(3)
    assert len(p) == 4
    assert p.victim(lambda s: True) is None


def test_s3fifo_resists_a_scan():
    p = S3FifoPolicy()
    hot = list(range(10))
    for s in hot:
        p.insert(s, 512, s)
        p.touch(s)
    live = set(hot)
    evicted_hot = 0
    for s in range(10, 200):  # a one-hit scan much larger than the cache
        p.insert(s, 512, s)
        live.add(s)
        while len(live) > 20:
            v = p.victim(lambda x: False)
            p.remove(v)
            p.remember(v)
            live.discard(v)
            evicted_hot += v in hot
        for h in hot:  # the hot set keeps being used
            if h in live:
                p.touch(h)
    assert evicted_hot == 0


def test_make_policy_rejects_unknown():
    assert make_policy("s3fifo").name == "s3fifo"
    with pytest.raises(ValueError):
        make_policy("mru")


def _key(i: int) -> bytes:
    return ObjectKey(b"n" * 16, i.to_bytes(16, "little"), 0, Role.KEY).pack()


def _put(t: DramTier, i: int, n: int = 1000) -> None:
    off = t.reserve(n)
    assert off is not None
    t.view(off, n)[:] = i % 251
    assert t.publish(_key(i), off, n, n, 0) is not None


def test_tier_evicts_demotes_and_respects_leases():
    demoted: list[tuple[ObjectKey, bytes]] = []
    t = DramTier(8 * 1024, demote=lambda ks, vs: demoted.extend(zip(ks, map(bytes, vs))) or len(ks))
    try:
        assert os.path.exists(t.arena.path) and t.arena.path.startswith("/dev/shm/")
        for i in range(4):  # 2 units each: the 16-unit pool holds 8
            _put(t, i)
        (lease,) = t.lease([_key(0)])
        assert lease is not None
        t.pin_chunks([_key(1)[:32]])
        for i in range(4, 12):
            _put(t, i)
        assert t.contains(_key(0)) and t.contains(_key(1))  # leased and pinned: never evicted
        assert t.evictions == t.demoted == len(demoted) == 4
        assert all(b == bytes([int.from_bytes(k.chunk, "little") % 251]) * 1000 for k, b in demoted)
        # Invalidation hides a leased object at once; its extent goes when the lease does.
        assert t.invalidate_keys([_key(0)]) == (1, 1000)
        assert not t.contains(_key(0)) and t.used_bytes == 16 * UNIT
        t.unlease([lease[:2]])
        assert t.used_bytes == 14 * UNIT
        t.unpin_chunks([_key(1)[:32]])
        assert (t.leases_active, len(t.chunk_pins), t.reserved_bytes, t.leased_bytes) == (0, 0, 0, 0)
        # Everything pinned: eviction takes the least recent pinned objects until the pins hold at most half
        # the pool (pin_share), no more.
        t.pin_chunks([k[:32] for k, _ in t.index.items()])
        pinned = [k[:32] for k, _ in t.index.items()]
        assert (t.pinned_units, t.pin_allowance) == (14, 8)
        assert t.reserve(3 * UNIT) is not None  # room for it: two pinned objects, the least recent, evicted
        assert (t.pinned_units, t.pins_evicted) == (10, 2)
        for i in range(100, 108):
            _put(t, i)
        assert (t.pinned_units, t.pins_evicted) == (8, 3)  # one more went; the pins' share stayed
        assert sum(t.index.chunk_count(p) for p in pinned) == 4
    finally:
        t.close()
    assert not os.path.exists(t.arena.path)


def test_tier_publish_of_present_key_frees_the_reservation():
    t = DramTier(4096)
    try:
        _put(t, 1)
        off = t.reserve(1000)
        assert t.publish(_key(1), off, 1000, 1000, 0) is None
        assert t.used_bytes == 2 * UNIT and t.reserved_bytes == 0
        off = t.reserve(1000)
        t.cancel(off, 1000)
        assert t.used_bytes == 2 * UNIT and t.reserved_bytes == 0
    finally:
        t.close()


_ARENA_CHILD = """
import os, sys, time
from orbitkv_fs.tiers.dram import DramTier
t = DramTier(1 << 20, shm_dir=sys.argv[1], pin=False)
print(t.arena.path, flush=True)
time.sleep(600)
"""


def _arena_child(shm_dir) -> "tuple[subprocess.Popen, str]":
    p = subprocess.Popen([sys.executable, "-c", _ARENA_CHILD, str(shm_dir)], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def _dead_pid() -> int:
    """A pid no process has here now."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_managers_arena_is_reclaimed_and_live_ones_are_kept(tmp_path):
    """A Manager killed with SIGKILL leaves its arena file (tmpfs memory, until removed): the next tier made
    in that directory removes it. A live arena, in this process or another, is never touched; nor is an
    arena whose owner holds its lock under a pid this process cannot see (another PID namespace), nor any
    file not named like an arena."""
    killed, killed_path = _arena_child(tmp_path)
    live, live_path = _arena_child(tmp_path)
    try:
        killed.kill()
        killed.wait()
        assert os.path.exists(killed_path) and os.path.getsize(killed_path) == 1 << 20
        # another namespace's live Manager: a pid not alive here, its lock held
        foreign = tmp_path / f"orbitkv-arena-{_dead_pid()}-0123abcd"
        foreign.write_bytes(b"x" * 4096)
        held = os.open(foreign, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
        others = [tmp_path / "orbitkv-pages-0123456789ab", tmp_path / f"orbitkv-arena-{_dead_pid()}-notours"]
        for f in others:
            f.write_bytes(b"y")
        t = DramTier(1 << 20, shm_dir=str(tmp_path), pin=False)
        try:
            assert t.reclaimed == (1, 1 << 20)
            assert not os.path.exists(killed_path)
            assert os.path.exists(live_path) and foreign.exists() and all(f.exists() for f in others)
            assert reclaim_stale_arenas(str(tmp_path)) == (0, 0)  # this tier's own arena is live too
            os.close(held)  # its owner gone: now it is stale
            assert reclaim_stale_arenas(str(tmp_path)) == (1, 4096) and not foreign.exists()
            assert os.path.exists(t.arena.path) and os.path.exists(live_path)
        finally:
            t.close()
    finally:
        live.kill()
        live.wait()
    assert reclaim_stale_arenas(str(tmp_path)) == (1, 1 << 20)  # the second child's, once killed
    assert sorted(os.listdir(tmp_path)) == sorted(f.name for f in others)


def _tier_state(t: DramTier) -> tuple:
    ix = t.index
    cols = (ix.offset, ix.units, ix.length, ix.logical, ix.generation, ix.rep, ix.state, ix.layer, ix.role)
    return (t.reserved_bytes, t.alloc.used, dict(t.resident_bytes), t.resident_logical, len(t.policy),
            [list(c) for c in cols], dict(ix.chunks), sorted(ix.items()))


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_publish_many_is_publish_in_order(policy):
    """Batches with keys present already (their reservations freed) and keys twice, of mixed
    representations, published by publish_many leave the same answers, index, policy size and byte
    accounting as publish of each in order."""
    rnd = random.Random(5)
    one, many = DramTier(1 << 20, policy=policy, pin=False), DramTier(1 << 20, policy=policy, pin=False)
    present = 0
    try:
        for _ in range(30):
            keys = [ObjectKey(b"n" * 16, rnd.randrange(20).to_bytes(16, "little"), layer, Role.KEY).pack()
                    for layer in rnd.sample(range(6), rnd.randrange(1, 6)) for _ in range(rnd.choice((1, 1, 2)))]
            sizes = [rnd.randrange(1, 3000) for _ in keys]
            reps = [rnd.choice((0, 0, 2)) for _ in keys]
            offs = one.reserve_many(sizes)
            assert many.reserve_many(sizes) == offs  # the same allocator history
            items = [(k, off, n, 2 * n, rep) for k, off, n, rep in zip(keys, offs, sizes, reps)]
            want = [one.publish(*it) is not None for it in items]
            assert many.publish_many(*zip(*items)) == want
            present += want.count(False)
            assert _tier_state(many) == _tier_state(one)
            for k in rnd.sample(sorted(set(keys)), len(set(keys)) // 2):  # room, and slots to reuse
                for t in (one, many):
                    t.invalidate_keys([k])
        assert one.reserved_bytes == many.reserved_bytes == 0 and present > 10
    finally:
        one.close()
        many.close()


@pytest.mark.parametrize("sizes", [[], [1000], [1000] * 5, [1, 512, 513, 4096, 3000, 512]])
def test_reserve_many_carves_one_extent_in_order(sizes):
    """A batch that fits is one extent carved in order, each piece its sizes' units long (one size or
    mixed; none for none); a second batch lies apart; cancelling every piece returns every byte."""
    t = DramTier(1 << 20, pin=False)
    try:
        units = [-(-n // UNIT) for n in sizes]
        offs = t.reserve_many(sizes)
        assert offs == [offs[0] + sum(units[:i]) * UNIT for i in range(len(sizes))]
        assert t.reserved_bytes == sum(units) * UNIT
        again = t.reserve_many(sizes)
        ends = [o + u * UNIT for o, u in zip(offs, units)]
        assert all(a >= max(ends) or a + u * UNIT <= min(offs) for a, u in zip(again, units))
        for o, n in zip(offs + again, sizes + sizes):
            t.cancel(o, n)
        assert t.reserved_bytes == 0
    finally:
        t.close()


def test_publish_many_raises_part_way_with_what_it_published_in_done():
    """A malformed key part way: the items before it are published (and in ``done``), it and the ones after
    stay reserved; cancelling those returns every byte."""
    t = DramTier(1 << 20, pin=False)
    try:
        keys = [_key(i) for i in range(6)]
        keys[3] = keys[3][:35]  # not a packed key
        offs = t.reserve_many([1000] * 6)
        items = [(k, off, 1000, 1000, 0) for k, off in zip(keys, offs)]
        done: list[bool] = []
        with pytest.raises(ValueError):
            t.publish_many(*zip(*items), done=done)
        assert done == [True] * 3
        assert [t.contains(k) for k in keys[:3]] == [True] * 3 and not t.contains(_key(4))
        assert t.reserved_bytes == 3 * 2 * UNIT and t.resident_bytes == {0: 3 * 2 * UNIT}
        for _, off, n, _, _ in items[len(done):]:
            t.cancel(off, n)
        assert t.reserved_bytes == 0 and t.used_bytes == 3 * 2 * UNIT
    finally:
        t.close()


def test_allocator_free_many_is_free_of_each():
    """Extents freed as a batch (neighbours among them merged first, in any order) leave the same free
    extents as freeing them one by one."""
    rnd = random.Random(3)
    for _ in range(50):
        one, many = Allocator(2000), Allocator(2000)
        live = []
        while (n := rnd.randint(1, 30)) and (s := one.alloc(n)) is not None:
            assert many.alloc(n) == s
            live.append((s, n))
        for _ in range(3):
            batch = rnd.sample(live, rnd.randrange(len(live) + 1))
            live = [x for x in live if x not in batch]
            for s, n in batch:
                one.free(s, n)
            many.free_many(np.array([s for s, _ in batch], dtype=np.uint32),
                           np.array([n for _, n in batch], dtype=np.int64))
            assert (many._by_start, many._by_end, many.used) == (one._by_start, one._by_end, one.used)
            assert [sorted(b) for b in many._bins] == [sorted(b) for b in one._bins]


def _fill(k: bytes) -> int:
    return (hash(k) & 0xFF) or 1


def _check_books(t: DramTier) -> None:
    """The tier's counters against its index: allocated units, resident bytes per representation, logical
    bytes, the policy's size."""
    ix = t.index
    rows = [s for s in range(len(ix.state)) if ix.state[s] != FREE]
    live = [s for s in rows if ix.state[s] == LIVE]
    assert t.alloc.used * UNIT == sum(ix.units[s] for s in rows) * UNIT + t.reserved_bytes
    resident: dict[int, int] = {}
    for s in live:
        resident[ix.rep[s]] = resident.get(ix.rep[s], 0) + ix.units[s] * UNIT
    assert {r: n for r, n in t.resident_bytes.items() if n} == resident
    assert t.resident_logical == sum(ix.logical[s] for s in live)
    assert len(t.policy) == len(ix) == len(live)


def test_drain_takes_slices_of_the_unheld_objects_and_passes_over_the_held_ones():
    """``drain`` (a DRAM flush, slice by slice) hands over copies of every object not leased nor pinned, at most
    about a slice's bytes a call, and counts the held ones it passed over; those stay."""
    t = DramTier(64 * UNIT, pin=False)
    try:
        for i in range(20):
            _put(t, i)
        (lease,) = t.lease([_key(3)])
        t.pin_chunks([_key(7)[:32]])
        got: list = []
        while True:
            objs, held = t.drain(3000)
            if not objs:
                break
            assert len(objs) <= 3 and held <= 2
            got += objs
        assert held == 2 and sorted(k.pack() for k, _ in got) == sorted(_key(i) for i in range(20) if i not in (3, 7))
        assert all(b == bytes([int.from_bytes(k.chunk, "little") % 251]) * 1000 for k, b in got)
        assert t.contains(_key(3)) and t.contains(_key(7)) and len(t.index) == 2
        t.unlease([lease[:2]])
        t.unpin_chunks([_key(7)[:32]])
        assert len(t.drain(1 << 20)[0]) == 2 and len(t.index) == 0
    finally:
        t.close()


def test_listing_pages_are_the_full_listing_cut():
    """A listing page (chunks a prefix test picks, keys after a cursor, at least ``limit`` rows) is the sorted
    listing of every object, filtered and cut; paging through it with each page's last key visits every
    object once, in key order."""
    rnd = random.Random(8)
    t = DramTier(4096 * UNIT, pin=False)
    try:
        keys = sorted({ObjectKey(bytes([65 + rnd.randrange(3)]) * 16, rnd.randrange(40).to_bytes(16, "little"),
                                 rnd.randrange(5), rnd.choice([Role.KEY, Role.VALUE])).pack() for _ in range(600)})
        for k in rnd.sample(keys, len(keys)):  # the index's chunks in another order than the keys'
            off = t.reserve(300)
            t.view(off, 300)[:] = 1
            assert t.publish(k, off, 300, 300, 0) is not None
        full = t.listing()
        assert [r[0] for r in full] == keys
        for ns in (None, b"B" * 16):
            match = None if ns is None else (lambda p, ns=ns: p[:16] == ns)
            want = [r for r in full if ns is None or r[0][:16] == ns]
            for after in (b"", keys[0], keys[len(keys) // 2], keys[len(keys) // 2][:32], keys[-1], b"C" * 20):
                for limit in (1, 7, 1000):
                    got = t.listing(match, after=after, limit=limit)
                    cut = [r for r in want if r[0] > after]
                    assert len(got) >= min(limit, len(cut)) and got == cut[:len(got)]
            pages, after = [], b""
            while True:
                got = t.listing(match, after=after, limit=9)
                if not got:
                    break
                pages += got[:9]
                after = got[:9][-1][0]
            assert pages == want
    finally:
        t.close()


def test_an_eviction_hands_its_victims_to_demote_in_one_call():
    """A save batch short of room evicts a batch of victims: ``demote`` gets them in one call, as views of
    their extents holding each object's bytes, before those extents are reused; what it answers is counted."""
    calls: list[list[tuple[ObjectKey, bytes]]] = []

    def demote(keys: list[ObjectKey], views: list[memoryview]) -> int:
        assert all(isinstance(v, memoryview) for v in views)
        calls.append([(k, bytes(v)) for k, v in zip(keys, views)])
        return len(keys) - 1  # the lower tier took all but one

    t = DramTier(64 * UNIT, pin=False, demote=demote)
    try:
        for i in range(16):  # 16 objects of 2 units each fill half the pool ...
            _put(t, i)
        offs = t.reserve_many([1000] * 24)  # ... and a batch of 24 more needs 16 units it does not have
        assert None not in offs and len(calls) == 1 and len(calls[0]) == t.evictions >= 8
        assert all(b == bytes([int.from_bytes(k.chunk, "little") % 251]) * 1000 for k, b in calls[0])
        assert t.demoted == t.evictions - 1
    finally:
        t.close()


def test_a_lower_tier_that_raises_does_not_stop_eviction(caplog):
    """A lower tier whose demotion raises (staging memory refused, a bug): the victims still leave DRAM, the
    batch gets its room, the books hold, none counts as demoted, and the failure is logged once a minute."""
    def demote(keys: list[ObjectKey], views: list[memoryview]) -> int:
        raise OSError(12, "Cannot allocate memory")

    t = DramTier(64 * UNIT, pin=False, demote=demote)
    try:
        for i in range(32):  # the pool full
            _put(t, i)
        held = []
        for _ in range(2):  # two batches short of room: two evictions, both failing to demote
            offs = t.reserve_many([1000] * 4)
            assert None not in offs
            held += offs
        assert t.evictions == 8 and t.demoted == 0 and len(t.index) == 24
        for o in held:
            t.cancel(o, 1000)
        _check_books(t)
        assert sum("demoting" in r.getMessage() for r in caplog.records) == 1
    finally:
        t.close()


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_saves_into_a_full_tier_evict_what_they_need_and_keep_the_books(policy):
    """Save batches (chunks of several segments, one size or mixed) into a full tier with leases, chunk pins,
    invalidations: each evicted object was neither leased nor pinned and was demoted with its own bytes; what
    stays reads back its bytes; the counters match the index after every step; with LRU the victims are the
    least recently used objects not held, and the held ones met on the way become the most recent."""
    rnd = random.Random(21)
    demoted: list[tuple[bytes, bytes]] = []
    t = DramTier(96 * 1024, policy=policy, pin=False,
                 demote=lambda ks, vs: demoted.extend((k.pack(), bytes(v)) for k, v in zip(ks, vs)) or len(ks))
    lru: OrderedDict[bytes, None] = OrderedDict()  # least recent first
    leases: list[tuple[bytes, tuple[int, int]]] = []
    pins: list[bytes] = []
    chunk = 0
    try:
        for step in range(300):
            keys = [ObjectKey(b"n" * 16, (chunk + c).to_bytes(16, "little"), layer, role).pack()
                    for c in range(rnd.randrange(1, 4)) for layer in range(rnd.randrange(1, 4))
                    for role in (Role.KEY, Role.VALUE)]
            chunk += 8
            size = rnd.randrange(100, 4000)
            sizes = [size] * len(keys) if rnd.random() < 0.7 else [rnd.randrange(100, 4000) for _ in keys]
            held = {k for k, _ in leases} | {k for k in lru if k[:32] in pins}
            before = len(demoted)
            offs = t.reserve_many(sizes)
            victims = [k for k, _ in demoted[before:]]
            assert not held & set(victims)
            for k, b in demoted[before:]:
                assert b == bytes([_fill(k)]) * len(b)
            if policy == "lru":  # the oldest not held, in order; the held ones met on the way become the newest
                assert victims == [k for k in lru if k not in held][:len(victims)]
                if victims:
                    met = list(lru)[:list(lru).index(victims[-1])]
                    for k in met:
                        if k in held:
                            lru.move_to_end(k)
            for k in victims:
                lru.pop(k)
            for k, off, n in zip(keys, offs, sizes):
                if off is not None:
                    t.view(off, n)[:] = _fill(k)
            ok = [off is not None for off in offs]
            pub = [x for x, good in zip(zip(keys, offs, sizes), ok) if good]
            if pub:
                ks, os_, ns = zip(*pub)
                assert t.publish_many(list(ks), list(os_), list(ns), [2 * n for n in ns],
                                      [rnd.choice((0, 2)) for _ in ks]) == [True] * len(ks)
                lru.update(dict.fromkeys(ks))
            _check_books(t)
            op = rnd.random()
            if op < 0.3 and lru:
                k = rnd.choice(list(lru))
                (got,) = t.lease([k])
                leases.append((k, got[:2]))
                lru.move_to_end(k)
            elif op < 0.5 and leases:
                k, entry = leases.pop(rnd.randrange(len(leases)))
                t.unlease([entry])
            elif op < 0.6 and lru:
                p = rnd.choice(list(lru))[:32]
                t.pin_chunks([p])
                pins.append(p)
            elif op < 0.7 and pins:
                t.unpin_chunks([pins.pop(rnd.randrange(len(pins)))])
            elif op < 0.8 and lru:
                p = rnd.choice(list(lru))[:32]
                n = (t.invalidate_chunks([p]) if op < 0.75 else t.invalidate(lambda x: x == p))[0]
                gone = [k for k in lru if k[:32] == p]
                assert n == len(gone)
                for k in gone:
                    lru.pop(k)
            for k in rnd.sample(list(lru), min(3, len(lru))):
                assert t.read(k) == bytes([_fill(k)]) * len(t.read(k))
            _check_books(t)
        assert t.evictions == len(demoted) > 100
        for _, entry in leases:
            t.unlease([entry])
        t.unpin_chunks(pins)
        assert t.invalidate(lambda x: True)[0] == len(lru)
        assert t.alloc.used == t.reserved_bytes == 0 and t.alloc.largest_free() == t.alloc.total
    finally:
        t.close()


@pytest.mark.parametrize("per_batch", [8, 64])  # victims dropped one by one, and as array passes
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_full_tier_gives_a_batch_the_oldest_batch_s_room_in_one_extent(policy, per_batch):
    """The steady state of an engine whose prefixes outgrow DRAM: same-size save batches into a full tier.
    Each batch evicts exactly the oldest batch (whole chunks, one step: no more than it lacks) and is carved
    from one extent, the room those victims leave side by side; prefetched objects evicted unserved count
    as wasted. Also for one reservation per batch (a GPU batch's output region): the oldest region's room."""
    # 16 batches of segments of 4 units, and room for half a batch more: short of room by half a batch,
    # a batch evicts a whole one (evicting half would leave holes all over the oldest batch)
    t = DramTier(16 * per_batch * 2048 + per_batch // 2 * 2048, policy=policy, pin=False)
    chunks = per_batch // 2
    batches = []
    try:
        for b in range(40):
            keys = [ObjectKey(b"n" * 16, (b * chunks + c).to_bytes(16, "little"), layer, Role.KEY).pack()
                    for c in range(chunks) for layer in range(2)]
            evictions = t.evictions
            if b % 3 == 2:  # one region, published in pieces
                at = t.reserve(per_batch * 2048)
                offs = [at + i * 2048 for i in range(per_batch)]
            else:
                offs = t.reserve_many([2048] * per_batch)
            assert offs == [offs[0] + i * 2048 for i in range(per_batch)]
            assert t.evictions - evictions == (per_batch if b >= 16 else 0)
            if b >= 16:  # the oldest batch went, all of it
                assert not any(t.contains_many(batches[b - 16])) and all(t.contains_many(batches[b - 15]))
            n = per_batch
            assert t.publish_many(keys, offs, [2048] * n, [4096] * n, [0] * n) == [True] * n
            if b % 2:
                t.prefetched.update(t.index.get(k) for k in keys[:2])
            batches.append(keys)
            _check_books(t)
        assert t.evictions == 24 * per_batch and t.evicted_bytes == 24 * per_batch * 2048
        assert t.prefetch_wasted == 12 * 2 and len(t.index.chunks) == 16 * chunks
    finally:
        t.close()
