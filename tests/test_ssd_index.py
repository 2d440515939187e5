"""The SSD tier's index on its own (``orbitkv_fs.tiers.ssd.index``): which record each key reads, and the
live/dead byte gauges the allocator and the stats rely on. The tier's tests reach it only through whole
writes and reads, where a wrong gauge or a stale entry shows up late or not at all."""

from __future__ import annotations

from orbitkv_fs.tiers.ssd.index import SsdIndex
from orbitkv_fs.tiers.ssd.ring import Slot, State

from test_ssd_common import key


def _slot(i: int, generation: int, length: int, offset: int = 8192) -> Slot:
    return Slot(0, offset, length, key(i), generation, length - 4096, None, length - 4096, crc=generation)


def test_a_new_index_is_empty() -> None:
    idx = SsdIndex()
    assert (len(idx), idx.live, idx.dead, idx.pending) == (0, 0, 0, {})


def test_publish_makes_the_record_the_keys_own() -> None:
    idx = SsdIndex()
    s = _slot(1, generation=5, length=8192)
    assert idx.publish(s) is True
    assert idx[key(1)] is s and s.state is State.COMMITTED
    assert (idx.live, idx.dead) == (8192, 0)


def test_a_newer_generation_replaces_the_older_record() -> None:
    idx = SsdIndex()
    old, new = _slot(1, generation=5, length=8192), _slot(1, generation=9, length=12288, offset=16384)
    idx.publish(old)
    assert idx.publish(new) is True
    assert idx[key(1)] is new and len(idx) == 1
    assert old.state is State.DEAD and new.state is State.COMMITTED
    assert (idx.live, idx.dead) == (12288, 8192)


def test_an_older_generation_completing_late_stays_dead() -> None:
    # Two writes of one key in flight: the newer completed first, the older must not shadow it.
    idx = SsdIndex()
    new, old = _slot(1, generation=9, length=12288), _slot(1, generation=5, length=8192, offset=20480)
    idx.publish(new)
    assert idx.publish(old) is False
    assert idx[key(1)] is new and new.state is State.COMMITTED and old.state is State.DEAD
    assert (idx.live, idx.dead) == (12288, 8192)


def test_keys_are_independent() -> None:
    idx = SsdIndex()
    a, b = _slot(1, generation=3, length=8192), _slot(2, generation=2, length=4096, offset=16384)
    assert idx.publish(a) and idx.publish(b)
    assert idx[key(1)] is a and idx[key(2)] is b and idx.live == 12288


def test_kill_hides_a_committed_record_and_counts_it_dead() -> None:
    idx = SsdIndex()
    s = _slot(1, generation=5, length=8192)
    idx.publish(s)
    idx.kill(s)
    assert key(1) not in idx and s.state is State.DEAD
    assert (idx.live, idx.dead) == (0, 8192)
    idx.kill(s)  # twice (a corrupt read racing an invalidation): counted once
    assert (idx.live, idx.dead) == (0, 8192)


def test_kill_of_a_record_still_being_written_changes_nothing() -> None:
    idx = SsdIndex()
    published, writing = _slot(1, generation=5, length=8192), _slot(1, generation=6, length=4096, offset=16384)
    idx.publish(published)
    idx.kill(writing)
    assert writing.state is State.WRITING and idx[key(1)] is published
    assert (idx.live, idx.dead) == (8192, 0)


def _with_a_stray_committed_record() -> tuple[SsdIndex, Slot, Slot]:
    """An index naming ``named`` for key 1, beside ``other``: committed and counted live for that key too."""
    idx = SsdIndex()
    named, other = _slot(1, generation=9, length=8192), _slot(1, generation=5, length=4096, offset=16384)
    idx.publish(named)
    other.state = State.COMMITTED
    idx.live += other.length
    return idx, named, other


def test_kill_of_a_committed_record_the_index_no_longer_names_keeps_the_named_one() -> None:
    idx, named, other = _with_a_stray_committed_record()
    idx.kill(other)
    assert idx[key(1)] is named and other.state is State.DEAD
    assert (idx.live, idx.dead) == (8192, 4096)


def test_release_of_a_readable_record_is_an_eviction() -> None:
    idx = SsdIndex()
    s = _slot(1, generation=5, length=8192)
    idx.publish(s)
    assert idx.release(s) is True
    assert key(1) not in idx and (idx.live, idx.dead) == (0, 0)


def test_release_of_a_dead_record_returns_its_space() -> None:
    idx = SsdIndex()
    s = _slot(1, generation=5, length=8192)
    idx.publish(s)
    idx.kill(s)
    assert idx.release(s) is False
    assert (idx.live, idx.dead) == (0, 0)


def test_release_of_a_committed_record_the_index_no_longer_names_keeps_the_named_one() -> None:
    idx, named, other = _with_a_stray_committed_record()
    assert idx.release(other) is True
    assert idx[key(1)] is named and (idx.live, idx.dead) == (8192, 0)


def test_add_dead_counts_a_record_that_never_became_readable() -> None:
    idx = SsdIndex()
    s = _slot(1, generation=5, length=8192)
    idx.add_dead(s)
    assert s.state is State.DEAD and key(1) not in idx
    assert (idx.live, idx.dead) == (0, 8192)
    assert idx.release(s) is False and idx.dead == 0
