"""Eviction policies against models: LRU against an OrderedDict under random insert / touch / remove /
victim with random pins; S3-FIFO's queue counts and byte totals against the slots it holds, and neither
policy ever naming a pinned slot."""

from __future__ import annotations

import copy
import random
from collections import OrderedDict

import pytest
from eviction_lists import queue_order

from orbitkv_fs.tiers.eviction import LruPolicy, S3FifoPolicy, _Lists, make_policy


def test_lru_matches_an_ordered_dict():
    rnd = random.Random(3)
    p = LruPolicy()
    model: OrderedDict[int, None] = OrderedDict()  # least recent first
    for _ in range(5000):
        op = rnd.random()
        s = rnd.randrange(300)
        if op < 0.4:
            if s not in model:
                p.insert(s, 512, s)
                model[s] = None
        elif op < 0.7:
            p.touch(s)
            if s in model:
                model.move_to_end(s)
        elif op < 0.85:
            p.remove(s)
            model.pop(s, None)
        else:
            pinned = set(rnd.sample(range(300), 50))
            v = p.victim(pinned.__contains__)
            # The model: pinned tail entries rotate to the head, the first unpinned one is the victim.
            want = None
            for _ in range(len(model)):
                t = next(iter(model))
                if t not in pinned:
                    want = t
                    break
                model.move_to_end(t)
            assert v == want
        assert len(p) == len(model)


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_victims_are_never_pinned_and_accounting_returns_to_zero(name):
    rnd = random.Random(11)
    p = make_policy(name)
    held: set[int] = set()
    for step in range(4000):
        s = rnd.randrange(500)
        if s not in held:
            p.insert(s, 512 * rnd.randint(1, 8), rnd.randrange(1000))
            held.add(s)
        if rnd.random() < 0.5:
            p.touch(rnd.randrange(500))
        if len(held) > 200:
            v = p.victim(lambda x: x % 7 == 0)
            assert v is not None and v in held and v % 7
            p.remove(v)
            p.remember(v)
            held.discard(v)
        assert len(p) == len(held)
        if isinstance(p, S3FifoPolicy) and step % 500 == 0:
            lists = p._l
            assert sum(lists.count) == len(held)
            assert sum(lists.bytes) == sum(lists.size[s] for s in held)
    for s in list(held):
        p.remove(s)
    assert len(p) == 0
    if isinstance(p, S3FifoPolicy):
        assert p._l.bytes == [0, 0]
    assert p.victim(lambda x: False) is None


def test_policy_columns_stay_small():
    lru, s3 = LruPolicy(), S3FifoPolicy()
    for s in range(100_000):
        lru.insert(s, 512, s)
        s3.insert(s, 512, s)
    per = lambda p, cols: sum(c.itemsize * c.buffer_info()[1] for c in cols) / 100_000  # noqa: E731
    assert per(lru, (lru._l.prev, lru._l.next, lru._l.queue, lru._l.size, lru._l.freq)) == 9
    assert per(s3, (s3._l.prev, s3._l.next, s3._l.queue, s3._l.size, s3._l.freq)) == 14


def test_to_head_is_unlink_then_push_head():
    """LRU's touch moves a slot to the head in one step; over random touches, unlinks and inserts it
    leaves both link directions exactly as unlink + push_head does."""
    rng = random.Random(1)
    a, b = _Lists(1, weighted=False), _Lists(1, weighted=False)
    for s in range(50):
        a.push_head(0, s, 0)
        b.push_head(0, s, 0)
    for _ in range(5000):
        s, r = rng.randrange(50), rng.random()
        if r < 0.1:
            a.unlink(s)
            b.unlink(s)
        elif r < 0.2:
            if a.queue[s] < 0:
                a.push_head(0, s, 0)
                b.push_head(0, s, 0)
        elif a.queue[s] == 0:
            a.to_head(0, s)
            assert b.unlink(s) == 0
            b.push_head(0, s, 0)
        assert queue_order(a) == queue_order(b) and a.count == b.count


def _lists_state(p) -> tuple:
    l = p._l
    return (list(l.prev), list(l.next), list(l.queue), list(l.size), list(l.freq), l.head, l.tail, l.count, l.bytes,
            list(getattr(p, "_ghost", {})))


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_insert_many_is_insert_in_order(name):
    """Batches of inserts (fresh slots, reused ones out of order, keys whose hash is a ghost) leave the
    same lists, counts, byte totals and ghosts as insert of each in order; evictions in between make ghosts
    and free slots."""
    rnd = random.Random(11)
    one, many = make_policy(name), make_policy(name)
    linked: set[int] = set()
    for _ in range(200):
        free = [s for s in range(400) if s not in linked]
        slots = rnd.sample(free, min(len(free), rnd.randrange(1, 40)))
        if rnd.random() < 0.5:
            slots.sort()  # consecutive runs: the slice-assignment path
        nbytes = [512 * rnd.randrange(1, 9) for _ in slots]
        hashes = [rnd.randrange(60) for _ in slots]  # a small range: many are ghosts
        for s, n, h in zip(slots, nbytes, hashes):
            one.insert(s, n, h)
        many.insert_many(slots, nbytes, iter(hashes))
        linked.update(slots)
        assert _lists_state(many) == _lists_state(one)
        for _ in range(rnd.randrange(0, 30)):  # evict (ghosts) and touch (frequencies) the same way
            v = one.victim(lambda s: s % 7 == 0)
            assert many.victim(lambda s: s % 7 == 0) == v
            if v is None:
                break
            for p in (one, many):
                p.remember(v % 60)
                p.remove(v)
            linked.discard(v)
            t = rnd.choice(sorted(linked))
            one.touch(t)
            many.touch(t)
        assert _lists_state(many) == _lists_state(one)


def _linked_state(p) -> tuple:
    """What a policy holds: each queue head to tail, the linked slots' queue, size and frequency, the counts,
    byte totals and ghosts (an unlinked row's links are stale, whatever they say)."""
    l = p._l
    order = [queue_order(l, q) for q in range(len(l.head))]
    rows = sorted(s for q in order for s in q)
    return (order, [(l.queue[s], l.size[s] if l.weighted else 0, l.freq[s] if l.weighted else 0) for s in rows],
            sum(q >= 0 for q in l.queue) - len(rows), l.count, l.bytes, list(getattr(p, "_ghost", {})))


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_take_is_victim_and_remove_until_the_need(name):
    """take(need) names the victims victim() and remove() of each would, in that order, stopping once their
    units reach the need; the lists, counts, frequencies and ghosts after it are those of the one-by-one
    evictions (also with pinned slots met on the way, and when pinned slots leave fewer than the need)."""
    rnd = random.Random(7)
    one, many = make_policy(name), make_policy(name)
    units = [rnd.randrange(1, 9) for _ in range(400)]
    linked: set[int] = set()
    short = 0
    for _ in range(300):
        free = [s for s in range(400) if s not in linked]
        slots = rnd.sample(free, min(len(free), rnd.randrange(0, 40)))
        hashes = [rnd.randrange(60) for _ in slots]
        for p in (one, many):
            p.insert_many(slots, [512 * units[s] for s in slots], iter(hashes))
        linked.update(slots)
        for t in rnd.sample(sorted(linked), min(len(linked), rnd.randrange(0, 20))):
            one.touch(t)
            many.touch(t)
        pinned = set(rnd.sample(range(400), rnd.choice((0, 10, 200, 390))))
        need = rnd.randrange(0, 60)
        want, got = [], 0
        while got < need:
            v = one.victim(pinned.__contains__)
            if v is None:
                break
            one.remove(v)
            want.append(v)
            got += units[v]
        taken = many.take(need, units, pinned.__contains__)
        assert taken == want
        linked.difference_update(taken)
        short += got < need
        if got >= need:  # both walked the same slots: the same lists
            assert _linked_state(many) == _linked_state(one)
        else:  # only pinned slots left: the same ones linked, rotated in another order maybe
            assert len(many) == len(one) == len(linked)
            many = copy.deepcopy(one)  # go on from one state
        hs = [rnd.randrange(60) for _ in taken]
        for p in (one, many):
            p.remember_many(iter(hs))
        assert _linked_state(many) == _linked_state(one)
    assert short > 3


def test_lru_take_cuts_the_tail_run_and_leaves_a_consistent_list():
    """After take, the list walks the same from head and from tail, counts what it holds, and a taken slot
    can be inserted again (its queue entry says unlinked); taking everything empties it."""
    p = LruPolicy()
    p.insert_many(list(range(10)), [512] * 10, iter(range(10)))
    assert p.take(3, [1] * 10, lambda s: s == 1) == [0, 2, 3]
    assert queue_order(p._l) == [1, 9, 8, 7, 6, 5, 4] and len(p) == 7
    p.insert(2, 512, 2)
    assert queue_order(p._l)[0] == 2 and len(p) == 8
    assert p.take(100, [1] * 10, lambda s: False) == [4, 5, 6, 7, 8, 9, 1, 2]
    assert queue_order(p._l) == [] and len(p) == 0 and p.victim(lambda s: False) is None


def test_s3fifo_ghosts_stay_within_the_main_queue_s_bound_when_it_shrinks():
    """remember_many trims the ghost FIFO to its bound (the main queue's length, at least 1024) as remember
    does, also when the main queue shrank since the last eviction: the oldest ghosts go first."""
    p = S3FifoPolicy()
    p.insert_many(list(range(3000)), [512] * 3000, iter(range(3000)))
    p.touch_many(list(range(3000)))  # touched once: a victim search moves them to the main queue
    p.remove(p.victim(lambda s: False))
    main = p._l.count[1]
    assert main > 1024
    p.remember_many(iter(range(10_000, 10_000 + main)))
    assert len(p._ghost) == main
    for s in queue_order(p._l, 1)[:main - 1100]:  # the main queue shrinks below its ghosts
        p.remove(s)
    p.remember_many(iter([99_999]))
    assert len(p._ghost) == max(p._l.count[1], 1024) and next(reversed(p._ghost)) == 99_999
    assert next(iter(p._ghost)) == 10_000 + main - len(p._ghost) + 1
