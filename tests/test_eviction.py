"""Eviction policies against models: LRU against an OrderedDict under random insert / touch / remove /
victim with random pins; S3-FIFO's queue counts and byte totals against the slots it holds, and neither
policy ever naming a pinned slot."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

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
    def order(lists: _Lists) -> list[int]:
        fwd, s = [], lists.head[0]
        while s != -1:
            fwd.append(s)
            s = lists.next[s]
        back, s = [], lists.tail[0]
        while s != -1:
            back.append(s)
            s = lists.prev[s]
        assert back[::-1] == fwd
        return fwd

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
        assert order(a) == order(b) and a.count == b.count
