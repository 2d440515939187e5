"""SSD tier on real O_DIRECT files and real io_uring: publish, read, replace, ring overwrite, leases,
invalidation, stats, configuration errors."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orbitkv_fs.errors import SegmentError
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.tiers.ssd import SsdConfig, SsdConfigError, SsdIoError, SsdTier
from orbitkv_fs.tiers.ssd import reads
from orbitkv_fs.tiers.ssd.faults import FaultyBackend, Faults
from orbitkv_fs.tiers.ssd.reads import plan_reads
from orbitkv_fs.tiers.ssd.record import record_length
from orbitkv_fs.tiers.ssd.ring import Shard, Slot, State
from orbitkv_fs.tiers.ssd.staging import size_class
from orbitkv_fs.tiers.ssd.superblock import RING_START
from orbitkv_fs.tiers.ssd.uring import SysRing, UringBackend, aligned_buffer
from test_ssd_common import NS, direct_io_dir, key, segment


@pytest.fixture
def ssd_dir(tmp_path):
    return direct_io_dir(tmp_path)


def make(ssd_dir, *, shards=2, capacity=32 << 20, backend=None, **kw) -> SsdTier:
    paths = tuple(str(ssd_dir / f"shard{i}.okv") for i in range(shards))
    return SsdTier(SsdConfig(paths=paths, capacity=capacity, **kw), backend=backend)


def test_roundtrip_many_keys_two_shards(ssd_dir):
    with make(ssd_dir) as t:
        keys = [key(i, layer=i % 3) for i in range(64)]
        segs = {k: segment(i, layer=i % 3) for i, k in enumerate(keys)}
        assert all(t.submit(k, segs[k]) for k in keys)
        t.flush()
        assert all(t.contains(k) for k in keys)
        assert t.read_many(keys) == [segs[k] for k in keys]
        assert t.read(key(999)) is None
        s = t.snapshot()
        assert s.objects == 64 and s.write_completed_total == 64 and s.read_hits_total == 64
        assert s.live_bytes == sum(record_length(len(v)) for v in segs.values())
        assert {o.shard for o in t.iter_records()} == {0, 1}
        assert dict(t.iter_objects()) == {k: len(v) for k, v in segs.items()}
        assert t.stats()["ssd_objects"] == 64.0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 100, 4096])
def test_latency_quantiles_are_the_nearest_rank_below_of_the_last_samples(ssd_dir, n):
    """p50 and p99 of the read and write latencies: the sample at rank int(q * n) of the samples sorted, as the
    tier reported them when it sorted them whole."""
    rng = random.Random(n)
    with make(ssd_dir, shards=1) as t:
        reads_, writes = [rng.random() for _ in range(n)], [rng.expovariate(1.0) for _ in range(n)]
        t._read_lat.clear()
        t._write_lat.clear()
        t._read_lat.extend(reads_)
        t._write_lat.extend(writes)

        def rank(xs, q):
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

        s = t.snapshot()
        assert (s.read_latency_p50_seconds, s.read_latency_p99_seconds) == (rank(reads_, 0.5), rank(reads_, 0.99))
        assert (s.write_latency_p50_seconds, s.write_latency_p99_seconds) == (rank(writes, 0.5), rank(writes, 0.99))
        assert t.stats()["ssd_read_latency_p99_seconds"] == rank(reads_, 0.99)


def test_republish_replaces_and_old_generation_is_dead(ssd_dir):
    with make(ssd_dir, shards=1) as t:
        k = key(1)
        t.submit(k, segment(1))
        t.flush()
        g1 = next(t.iter_records()).generation
        t.submit(k, segment(1, version=1))
        t.flush()
        (o,) = list(t.iter_records())
        assert o.generation > g1
        assert t.read(k) == segment(1, version=1)
        s = t.snapshot()
        assert s.objects == 1 and s.dead_bytes == s.live_bytes


def test_ring_overwrites_oldest(ssd_dir):
    with make(ssd_dir, shards=1, capacity=2 << 20) as t:
        n = 250  # 250 x 20 KiB records through a 2 MiB ring: wraps twice
        for i in range(n):
            assert t.submit(key(i), segment(i))
            t.flush()
        s = t.snapshot()
        assert s.evicted_total > 0 and s.objects + s.evicted_total == n
        newest = [key(i) for i in range(n - s.objects, n)]
        assert all(t.contains(k) for k in newest)
        assert not t.contains(key(0))
        assert t.read_many(newest) == [segment(i) for i in range(n - s.objects, n)]


def test_leased_record_is_never_overwritten(ssd_dir):
    faults = Faults(read_delay=0.5)
    backend = FaultyBackend(UringBackend(), faults)
    with make(ssd_dir, shards=1, capacity=1 << 20, backend=backend) as t:
        t.submit(key(0), segment(0))
        t.flush()
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("v", t.read(key(0))))
        reader.start()
        time.sleep(0.1)  # the read holds its lease for 0.5 s
        for i in range(1, 80):  # ~1.6 MiB through a 1 MiB ring while the first record is leased
            t.submit(key(i), segment(i))
            t.flush()
        reader.join()
        assert got["v"] == segment(0)
        assert t.snapshot().write_skipped_blocked_total > 0


def test_records_being_written_are_skipped_or_dropped(ssd_dir):
    faults = Faults(write_delay=0.3)
    backend = FaultyBackend(UringBackend(), faults)
    with make(ssd_dir, shards=1, capacity=1 << 20, backend=backend, write_queue_depth=64) as t:
        accepted = [i for i in range(120) if t.submit(key(i), segment(i))]
        t.flush()
        s = t.snapshot()
        # Nothing in flight was overwritten: everything that published reads back intact.
        assert s.write_dropped_total == 120 - len(accepted) > 0
        live = [i for i in accepted if t.contains(key(i))]
        assert live and t.read_many([key(i) for i in live]) == [segment(i) for i in live]
        assert s.corrupt_records_total == 0 and t.snapshot().corrupt_records_total == 0


def test_lane_bound_drops_and_counts(ssd_dir):
    # Each write's completion is held back longer than eight submits of 8 MiB take on a loaded machine (copying
    # into fresh staging pages: 0.2 GB/s on the development VM), so none frees its bytes before the last submit.
    faults = Faults(write_delay=2.0)
    with make(ssd_dir, shards=1, capacity=128 << 20, backend=FaultyBackend(UringBackend(), faults),
              max_pending_bytes=33 << 20) as t:
        big = segment(0, n=4 << 20)  # 8 MiB segments: only four fit in the staging bound
        results = [t.submit(key(i), big) for i in range(8)]
        t.flush()
        assert results.count(True) == 4 and t.snapshot().write_dropped_total == 4
        assert t.snapshot().pending_bytes == 0


def test_submit_many_copies_each_segment_before_it_returns(ssd_dir):
    """A batch (DRAM's eviction hands views of extents it reuses at once) is taken as ``submit`` of each: what
    a read answers while the writes are held back, and from disk once they land, is what each view held when
    the call was made, though the test overwrites every source right after it. A key twice in a batch: the
    later segment wins."""
    faults = Faults(write_delay=0.3)
    with make(ssd_dir, backend=FaultyBackend(UringBackend(), faults)) as t:
        segs = [segment(i, n=4096 + 977 * i) for i in range(24)] + [segment(3, version=1)]
        keys = [key(i) for i in range(24)] + [key(3)]
        arena = bytearray(b"".join(segs))
        views, at = [], 0
        for seg in segs:
            views.append(memoryview(arena)[at:at + len(seg)])
            at += len(seg)
        assert t.submit_many(keys, views) == 25
        arena[:] = bytes(len(arena))  # the extents are reused: the tier must not have kept them
        want = segs[:3] + [segs[24]] + segs[4:24]
        assert t.snapshot().objects == 0  # held back: every read below is served from the pending copies
        pending = t.read_many(keys[:24])
        assert pending == want and all(isinstance(b, bytes) for b in pending)
        assert t.snapshot().read_pending_hits_total == 24
        faults.write_delay = 0.0
        t.flush()
        s = t.snapshot()
        assert s.objects == 24 and s.write_submitted_total == 25 and s.write_completed_total == 25
        assert t.read_many(keys[:24]) == want
        # The pending bytes read before the writes landed were copies: the staging buffers they came from
        # went back to the pool and staged the next batch, and those reads still hold the first bytes.
        assert t.submit_many([key(100 + i) for i in range(24)], [segment(100 + i) for i in range(24)]) == 24
        t.flush()
        assert pending == want


def test_submit_many_checks_every_segment_before_it_stages_any(ssd_dir):
    with make(ssd_dir) as t:
        good = [segment(i) for i in range(4)]
        damaged = bytearray(segment(9))
        damaged[17] ^= 1  # its header CRC no longer matches
        for bad in (b"not a segment" * 10, segment(9) + b"\0", bytes(damaged)):
            with pytest.raises(SegmentError):
                t.submit_many([key(i) for i in range(5)], good[:2] + [bad] + good[2:])
        t.flush()
        assert t.snapshot().write_submitted_total == 0 and not any(t.contains(key(i)) for i in range(5))


def test_submit_many_drops_what_the_lane_has_no_room_for(ssd_dir):
    """A batch larger than the lane's staging bound: the records that fit are queued, the rest dropped and
    counted, nothing staged for them; what was taken reads back. A segment already on disk counts as taken
    and is not written again."""
    faults = Faults(write_delay=0.2)
    with make(ssd_dir, shards=1, capacity=128 << 20, backend=FaultyBackend(UringBackend(), faults),
              max_pending_bytes=33 << 20) as t:
        big = [segment(i, n=4 << 20) for i in range(8)]  # 8 MiB segments: four fit in the staging bound
        assert t.submit_many([key(i) for i in range(8)], big) == 4
        assert t.snapshot().write_dropped_total == 4 and t._staging._host_bytes == 0  # no buffer for the four
        faults.write_delay = 0.0
        t.flush()
        assert [t.contains(key(i)) for i in range(8)] == [True] * 4 + [False] * 4
        assert t.read_many([key(i) for i in range(4)]) == big[:4]
        assert t.submit_many([key(0), key(5)], [big[0], big[5]]) == 2
        t.flush()
        s = t.snapshot()
        assert s.write_already_stored_total == 1 and s.write_submitted_total == 5 and s.pending_bytes == 0
        assert t.read(key(5)) == big[5]


def test_a_batch_for_a_shard_is_placed_end_to_end_from_one_search(ssd_dir, monkeypatch):
    """Eviction's batch: a shard's records go end to end from one place the ring's search found for all of them,
    in generation order, each its own record of the chain: they read back, and a restart recovers them all
    (twice named keys keep the later segment)."""
    searches = []
    real = Shard.find_room
    monkeypatch.setattr(Shard, "find_room", lambda sh, n: searches.append(n) or real(sh, n))
    with make(ssd_dir, shards=2) as t:
        keys = [key(i, layer=i % 3) for i in range(40)] + [key(3, layer=0)]
        segs = [segment(i, layer=i % 3) for i in range(40)] + [segment(3, layer=0, version=1)]
        assert t.submit_many(keys, segs) == 41
        assert len(searches) == 2  # one search a shard, not one a record
        t.flush()
        for sh in t._shards:
            mine = sorted(sh.slots.values(), key=lambda x: x.generation)
            assert len(mine) > 1 and sum(x.length for x in mine) in searches
            assert all(b.offset == a.end for a, b in zip(mine, mine[1:]))
        want = [segment(i, layer=i % 3) if i != 3 else segs[-1] for i in range(40)]
        assert t.read_many(keys[:40]) == want
        paths = t.config.paths
    with SsdTier(SsdConfig(paths=paths, capacity=32 << 20, recover=True)) as t:
        s = t.snapshot()
        assert s.objects == 40 and s.recovered_chain_breaks_total == 0 and s.recovered_torn_total == 0
        assert t.read_many(keys[:40]) == want


def test_a_batch_with_no_run_long_enough_is_placed_record_by_record(ssd_dir):
    """Leased records every few places leave no run of the ring as long as the batch: its records still go in
    one by one, around them, and nothing is dropped."""
    rec = record_length(len(segment(0, n=24576)))  # 52 KiB: a ring of 24 is over the 1 MiB a shard needs
    with make(ssd_dir, shards=1, capacity=RING_START + 24 * rec) as t:  # 24 records fill the ring
        for i in range(24):
            assert t.submit(key(i), segment(i, n=24576), timeout=5.0)
        t.flush()
        held = [s for s in t._shards[0].slots.values() if (s.offset - RING_START) // rec % 4 == 3]
        for s in held:  # leased: readers hold them, the ring must go around
            s.leases += 1
        try:
            new = [key(100 + i) for i in range(12)]
            assert t.submit_many(new, [segment(100 + i, n=24576) for i in range(12)]) == 12
            t.flush()
            assert t.read_many(new) == [segment(100 + i, n=24576) for i in range(12)]
            assert t.snapshot().write_dropped_total == 0
        finally:
            for s in held:
                s.leases -= 1
        first = {key(i): segment(i, n=24576) for i in range(24)}
        assert held and t.read_many([s.key for s in held]) == [first[s.key] for s in held]  # went around them


def _room_by_scan(sh: Shard, length: int):
    """:meth:`Shard.find_room` by a scan of every slot: from the head, the first place whose overlapping
    slots are neither being written nor leased (the first such slot in offset order is the one skipped)."""
    pos, travelled, skips = sh.head, 0, 0
    while travelled <= sh.capacity - RING_START:
        if pos + length > sh.capacity:
            travelled += sh.capacity - pos
            pos = RING_START
            continue
        over = [sh.slots[o] for o in sorted(sh.slots) if o < pos + length and sh.slots[o].end > pos]
        blocker = next((v for v in over if v.state is State.WRITING or v.leases), None)
        if blocker is None:
            return pos, over, skips
        skips += 1
        travelled += blocker.end - pos
        pos = blocker.end
    return None


def test_a_shards_search_for_room_is_a_scan_of_its_slots():
    """A shard under random allocations, with records being written and leased ones in the way: every
    ``find_room`` answers what a scan of all its slots finds (place, victims, skips), and the allocations
    it leads to keep the slots apart, the offsets sorted and the records by chunk those of the ring."""
    rnd = random.Random(5)
    block = 4096
    sh = Shard(0, "", 0, RING_START + 300 * block, b"\0" * 32, -1)
    gen = 0
    for step in range(3000):
        length = rnd.randrange(1, 24) * block
        if rnd.random() < 0.1:  # a search from any place, also inside a record
            sh.head = RING_START + rnd.randrange(300) * block
        got = sh.find_room(length)
        want = _room_by_scan(sh, length)
        assert (got is None) == (want is None), step
        if got is None:
            for v in list(sh.slots.values()):  # unblock: writes end, leases go
                v.state, v.leases = State.COMMITTED, 0
            continue
        assert (got[0], [v.offset for v in got[1]], got[2]) == (want[0], [v.offset for v in want[1]], want[2])
        pos, victims, _ = got
        for v in victims:
            sh.remove(v)
        sh.head = pos + length
        gen += 1
        slot = Slot(0, pos, length, key(gen % 7, layer=gen % 3), gen, length - 128, None, 0)
        slot.state = State.WRITING if rnd.random() < 0.2 else State.COMMITTED
        slot.leases = int(rnd.random() < 0.1)
        sh.insert(slot)
        for v in rnd.sample(list(sh.slots.values()), min(3, len(sh.slots))):  # some writes end, some leases go
            if rnd.random() < 0.5:
                v.state, v.leases = State.COMMITTED, 0
        offs = list(sh.offsets)
        assert offs == sorted(sh.slots)
        assert all(sh.slots[a].end <= b for a, b in zip(offs, offs[1:]))
        if step % 50 == 0:  # the records by chunk are the records, grouped
            groups: dict = {}
            for v in sh.slots.values():
                groups.setdefault(v.key.namespace + v.key.chunk, set()).add(v)
            assert {p: set(sh.chunk_records(p)) for p in sh.by_chunk} == groups
            assert set(sh.chunk_slots({NS + chunk_key(3), NS + chunk_key(99)})) == groups.get(NS + chunk_key(3), set())


def test_invalidate_keys_and_namespace(ssd_dir):
    other = bytes(16)
    with make(ssd_dir) as t:
        for i in range(10):
            t.submit(key(i), segment(i))
            t.submit(key(i, ns=other), segment(i))
        t.flush()
        r = t.invalidate(keys=[key(0), key(1)])
        assert (r.objects, r.bytes) == (2, 2 * len(segment(0)))
        assert not t.contains(key(0)) and t.read(key(1)) is None
        r = t.invalidate(namespace=NS)
        assert r.objects == 8
        assert t.contains(key(5, ns=other))
        assert t.invalidate(all=True).objects == 10
        t.flush()
        s = t.snapshot()
        assert s.objects == 0 and s.invalidated_total == 20
        # Durable on return: a tombstone in each key's shard, one per shard for the namespace, a raised
        # floor (no record) for all; each answered after a checkpoint.
        shards = {t._shard_of(k).index for k in (key(0), key(1))}
        assert (s.tombstones_total, s.tombstone_fallbacks_total) == (len(shards) + 2, 0)
        assert s.checkpoints_total >= len(shards) + 2 + 2
        with pytest.raises(ValueError):
            t.invalidate()


@pytest.mark.parametrize("by", ["keys", "namespace"])
def test_invalidate_while_writing_is_never_published(ssd_dir, by):
    faults = Faults(write_delay=0.3)
    with make(ssd_dir, backend=FaultyBackend(UringBackend(), faults)) as t:
        t.submit(key(0), segment(0))
        t.invalidate(**({"keys": [key(0)]} if by == "keys" else {"namespace": NS}))
        t.flush()
        assert not t.contains(key(0)) and t.snapshot().write_cancelled_total == 1


def test_contains_many_is_contains_of_each(ssd_dir):
    faults = Faults()
    with make(ssd_dir, backend=FaultyBackend(UringBackend(), faults)) as t:
        for i in range(4):
            t.submit(key(i), segment(i))
        t.flush()
        t.invalidate(keys=[key(1)])
        faults.write_delay = 0.5
        t.submit(key(9), segment(9))  # pending: readable from memory
        keys = [key(i) for i in (0, 1, 2, 3, 9, 10)]
        assert t.contains_many(keys) == [t.contains(k) for k in keys] == [True, False, True, True, True, False]
        t.flush()


def test_listing_pages_are_the_readable_objects_sorted_and_cut(ssd_dir):
    """A page of ``listing`` is the readable objects (as ``iter_objects``: published records, then first writes in
    flight) of the chunks it matches, after its cursor, sorted: superseded and invalidated records are not
    rows, and a cursor anywhere (a key, between keys, inside a chunk) cuts the listing there."""
    other = bytes(16)
    faults = Faults()
    with make(ssd_dir, backend=FaultyBackend(UringBackend(), faults)) as t:
        for i in range(12):
            for layer in range(3):
                t.submit(key(i, layer=layer, ns=other if i % 4 == 0 else NS), segment(i, layer=layer))
        t.flush()
        t.submit(key(1, layer=1), segment(1, layer=1, version=1))  # republished: the old record is superseded
        t.invalidate(keys=[key(2, layer=2)])
        t.flush()
        faults.write_delay = 0.5  # first writes in flight: readable from memory, rows of their own
        for layer in range(2):
            t.submit(key(20, layer=layer), segment(20, layer=layer))
        full = sorted((k.pack(), n) for k, n in t.iter_objects())
        assert len(full) == 12 * 3 - 1 + 2 and key(20).pack() in dict(full) and key(2, layer=2).pack() not in dict(full)
        assert t.listing() == full
        assert t.listing(lambda p: p[:16] == other) == [r for r in full if r[0][:16] == other]
        cuts = ([b""] + [kb for kb, _ in full] + [kb[:32] for kb, _ in full[::5]]
                + [kb[:-1] + b"\xff" for kb, _ in full[::3]])
        for after in cuts:
            rest = [r for r in full if r[0] > after]
            for limit in (1, 3, 7):
                rows = t.listing(after=after, limit=limit)
                assert len(rows) >= min(limit, len(rest)) and rows == rest[:len(rows)], (after.hex(), limit)
        t.flush()


def test_submit_rejects_non_segments_and_closed_tier_drops(ssd_dir):
    t = make(ssd_dir)
    with pytest.raises(SegmentError):
        t.submit(key(0), b"not a segment" * 10)
    with pytest.raises(SegmentError):
        t.submit(key(0), segment(0) + b"\0")
    damaged = bytearray(segment(0))
    damaged[17] ^= 1  # original_length: the segment header CRC no longer matches
    with pytest.raises(SegmentError):
        t.submit(key(0), bytes(damaged))
    assert t.snapshot().write_submitted_total == 0
    t.close()
    t.close()
    assert t.submit(key(0), segment(0)) is False
    assert t.read(key(0)) is None


def test_config_errors(ssd_dir):
    with pytest.raises(SsdConfigError):
        SsdConfig(paths=(), capacity=1 << 30)
    with pytest.raises(SsdConfigError):
        SsdConfig(paths=("a", "a"), capacity=1 << 30)
    with pytest.raises(SsdConfigError):
        SsdConfig(paths=("a",), capacity=1 << 30, backend="spdk")
    with pytest.raises(SsdConfigError):
        SsdConfig(paths=("a",), capacity=1 << 30, write_queue_depth=0)
    with pytest.raises(SsdConfigError):
        SsdConfig(paths=("a",), capacity=1000)


def test_unusable_path_is_a_clear_error(ssd_dir):
    with pytest.raises(SsdIoError, match="cannot open"):
        SsdTier(SsdConfig(paths=(str(ssd_dir / "missing-dir" / "shard.okv"),), capacity=4 << 20))


@pytest.mark.parametrize("ext_arg", [True, False], ids=["in-io_uring_enter", "eventfd-fallback"])
def test_a_ring_wait_with_a_timeout_returns_at_it_or_with_the_completion(ssd_dir, ext_arg, monkeypatch):
    """A demand read's deadline: the wait in one io_uring_enter (IORING_ENTER_EXT_ARG), or on a kernel
    without it the eventfd wait, returns nothing at the timeout, and a read's completion before it."""
    from orbitkv_fs.tiers.ssd import uring

    fallback = []
    base_wait = uring.EventfdRing.submit_and_wait
    monkeypatch.setattr(uring.EventfdRing, "submit_and_wait",
                        lambda self, timeout=None: fallback.append(timeout) or base_wait(self, timeout))
    backend = UringBackend()
    ring = backend.ring(8)
    try:
        if not ext_arg:
            ring._ext_arg = False
        elif not ring._ext_arg:
            pytest.skip("this kernel's io_uring has no IORING_FEAT_EXT_ARG")
        for _ in range(3):  # each call alike (a Python int as the argument size failed some calls only)
            t0 = time.monotonic()
            assert ring.submit_and_wait(0.2) == []
            assert 0.15 <= time.monotonic() - t0 < 2.0
        path = ssd_dir / "wait.bin"
        fid = backend.open(str(path), 1 << 20, truncate=True)
        buf = aligned_buffer(4096)
        ring.prep_read(fid, buf, 0, 7)
        t0 = time.monotonic()
        assert ring.submit_and_wait(5.0) == [(7, 4096)]
        assert time.monotonic() - t0 < 2.0
        assert bool(fallback) is not ext_arg  # the kernel's own timeout where it has one, else the eventfd's
    finally:
        ring.close()
        backend.close()


def test_uring_backend_is_the_syscall_ring_and_starts_without_a_child_process(ssd_dir):
    """No driver probe at start: opening a tier once cost a child-process self-test of the liburing package
    (~0.6 s in every process). A fresh interpreter, so that no probe result cached by earlier tests hides
    one; every way to start a process is refused and recorded there."""
    backend = UringBackend()
    ring = backend.ring(8)
    try:
        assert type(ring) is SysRing
    finally:
        ring.close()
        backend.close()
    code = textwrap.dedent("""
        import os, subprocess, sys
        spawned = []

        def refuse(name):
            def call(*a, **kw):
                spawned.append(name)
                raise RuntimeError(f"the SSD tier started a process ({name})")
            return call

        subprocess.Popen = refuse("subprocess.Popen")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
            if hasattr(os, name):
                setattr(os, name, refuse("os." + name))
        from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

        d = sys.argv[1]
        with SsdTier(SsdConfig(paths=(d + "/s0.okv", d + "/s1.okv"), capacity=8 << 20)):
            pass
        assert not spawned, spawned
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code, str(ssd_dir)], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-4000:]


def test_concurrent_writers_readers_invalidations_stay_consistent(ssd_dir):
    """Small ring (constant overwrites), threads submitting new versions, reading and invalidating: a read
    returns a version that was submitted for that key or None, never other bytes; gauges return to rest."""
    versions = {i: [segment(i, n=4096, version=v) for v in range(4)] for i in range(12)}
    errors: list[str] = []
    with make(ssd_dir, shards=2, capacity=2 << 20, write_queue_depth=8) as t:
        def writer(seed: int) -> None:
            import random

            r = random.Random(seed)
            for _ in range(150):
                if seed % 2:  # eviction's batches: a shard's records placed from one search of the ring
                    ks = [r.randrange(12) for _ in range(3)]
                    t.submit_many([key(i) for i in ks], [versions[i][r.randrange(4)] for i in ks])
                    continue
                i = r.randrange(12)
                t.submit(key(i), versions[i][r.randrange(4)])

        def reader(seed: int) -> None:
            import random

            r = random.Random(seed)
            for _ in range(150):
                ks = r.sample(range(12), 8)  # read in windows of extents (records end to end come in together)
                for i, got in zip(ks, t.read_many([key(i) for i in ks])):
                    if got is not None and got not in versions[i]:
                        errors.append(f"key {i}: bytes that were never submitted")

        def invalidator() -> None:
            for j in range(30):
                t.invalidate(keys=[key(j % 12)])
                time.sleep(0.002)

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
        threads += [threading.Thread(target=reader, args=(s,)) for s in range(2)]
        threads.append(threading.Thread(target=invalidator))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        t.flush()
        assert not errors
        s = t.snapshot()
        assert s.writing_bytes == 0 and s.pending_bytes == 0 and s.corrupt_records_total == 0
        live = list(t.iter_records())
        assert s.live_bytes == sum(record_length(o.stored_bytes) for o in live)
        for o in live:
            assert t.read(o.key) in versions[next(i for i in range(12) if key(i) == o.key)]


def test_read_many_sink_streams_and_survives_a_raising_sink(ssd_dir):
    with make(ssd_dir) as t:
        keys = [key(i) for i in range(40)]
        for i, k in enumerate(keys):
            t.submit(k, segment(i))
        t.flush()
        got = {}
        # the sink gets a view of the read buffer, valid during the call: a consumer copies what it keeps
        out = t.read_many(keys + [key(999)], sink=lambda i, b: got.__setitem__(i, bytes(b)))
        assert out == [None] * 41 and got == {i: segment(i) for i in range(40)}

        def bad_sink(i, b):
            raise RuntimeError("consumer failed")

        with pytest.raises(RuntimeError):
            t.read_many(keys, sink=bad_sink)
        # The ring went back clean and no lease leaked: everything still reads and can be overwritten.
        assert t.read_many(keys) == [segment(i) for i in range(40)]
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values())
        assert t.snapshot().read_hits_total == 40 + 1 + 40


def test_a_reads_plan_puts_records_end_to_end_on_disk_in_one_read_and_cuts_windows():
    # (index, shard, offset, length): two runs in shard 0 (the second one out of order in the request), one
    # record of shard 1 right where shard 0's run ends (another file: not joined), a key named twice.
    places = [(0, 0, 8192, 4096), (1, 0, 4096, 4096), (2, 0, 40960, 8192), (3, 1, 53248, 4096),
              (4, 0, 32768, 8192), (5, 0, 4096, 4096), (6, 0, 49152, 4096)]
    (w,) = plan_reads(places, 1 << 20, 64)
    assert [r[0] for r in w.records] == [1, 5, 0, 4, 2, 6, 3]  # disk order; the twice-named key twice
    # buffer positions follow one another; each extent is one read of records that follow on disk
    assert [r[1] for r in w.records] == [0, 4096, 8192, 12288, 20480, 28672, 32768]
    assert w.extents == [[0, 4096, 0, 4096], [0, 4096, 4096, 8192], [0, 32768, 12288, 20480],
                         [1, 53248, 32768, 4096]]
    assert [r[2] for r in w.records] == [0, 1, 1, 2, 2, 2, 3] and w.nbytes == 36864 and w.left == 4
    # A window holds at most ``window`` bytes of records, at least one, and an extent never crosses windows.
    ws = plan_reads(places, 12288, 64)
    assert [[r[0] for r in x.records] for x in ws] == [[1, 5, 0], [4], [2, 6], [3]]
    assert [x.extents for x in ws] == [[[0, 4096, 0, 4096], [0, 4096, 4096, 8192]], [[0, 32768, 0, 8192]],
                                       [[0, 40960, 0, 12288]], [[1, 53248, 0, 4096]]]
    # ... and at most ``extents`` reads: a record that joins the last one's read still comes in.
    assert [[r[0] for r in x.records] for x in plan_reads(places, 1 << 20, 2)] == [[1, 5, 0], [4, 2, 6, 3]]
    assert [r[0] for r in plan_reads([(0, 0, 0, 1 << 20)], 4096, 1)[0].records] == [0]
    assert plan_reads([], 4096, 1) == []


@pytest.mark.parametrize("window", [1 << 20, 3 * 20480, 20480])
def test_read_many_over_many_windows_serves_every_record_and_holds_few_buffers(ssd_dir, monkeypatch, window):
    """Records end to end and apart on disk, read in windows smaller than the read (one record each, at the
    smallest), the read-ahead cut short: every segment reaches the sink, in the right place, once."""
    monkeypatch.setattr(reads, "READ_WINDOW", window)
    monkeypatch.setattr(reads, "READ_AHEAD", 2 * window)
    with make(ssd_dir, shards=2) as t:
        keys = [key(i) for i in range(96)]
        for i, k in enumerate(keys):
            assert t.submit(k, segment(i), timeout=5.0)
        t.flush()
        taken, out, peak = [], {}, [0]
        real_host, real_recycle = t._staging.host, t._staging.recycle

        def host(n):
            buf = real_host(n)
            taken.append(n)
            out[id(buf)] = n
            peak[0] = max(peak[0], sum(out.values()))
            return buf

        def recycle(buf):
            out.pop(id(buf), None)
            real_recycle(buf)

        monkeypatch.setattr(t._staging, "host", host)
        monkeypatch.setattr(t._staging, "recycle", recycle)
        for want in (keys, keys[::3] + [key(500)] + keys[1::3]):
            got = {}
            assert t.read_many(want, sink=lambda i, b: got.__setitem__(i, bytes(b))) == [None] * len(want)
            assert got == {i: segment(keys.index(k)) for i, k in enumerate(want) if k in keys}
            assert t.read_many(want) == [segment(keys.index(k)) if k in keys else None for k in want]
        assert taken and max(taken) <= window and not out  # every window buffer went back
        assert peak[0] <= 2 * window  # two windows, or the read-ahead's bytes
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values())


def test_a_short_read_serves_the_records_it_covered_and_invalidates_none(ssd_dir):
    with make(ssd_dir, shards=1) as t:
        keys = [key(i) for i in range(12)]
        for i, k in enumerate(keys):
            assert t.submit(k, segment(i), timeout=5.0)
        t.flush()
        recs = sorted((o.offset, o.key) for o in t.iter_records())
        assert [k for _, k in recs] == keys  # end to end: one read for all of them
        rec = record_length(len(segment(0)))
        assert all(b[0] - a[0] == rec for a, b in zip(recs, recs[1:]))
        # The disk ends 4 KiB into the sixth record: the read of all twelve comes back short.
        os.truncate(t.config.paths[0], recs[5][0] + 4096)
        assert t.read_many(keys) == [segment(i) for i in range(5)] + [None] * 7
        s = t.snapshot()
        assert (s.read_hits_total, s.read_errors_total, s.corrupt_records_total) == (5, 7, 0)
        assert s.errors_by_errno == {"short_read": 7}
        assert all(t.contains(k) for k in keys)  # an I/O error invalidates nothing


def test_records_and_keys_are_not_tracked_by_the_cycle_collector(ssd_dir):
    """A cache holds a slot and a key per record, millions of them: tracked, every full collection of the
    Manager's process would traverse them all with the GIL held (docs/results/2026-12-05-gc-pauses)."""
    with make(ssd_dir, shards=1) as t:
        for i in range(8):  # one chunk of eight segments
            assert t.submit(key(0, layer=i), segment(i, layer=i))
        t.flush()
        slots = [s for sh in t._shards for s in sh.slots.values()]
        assert len(slots) == 8 and len(t._index) == 8
        assert not any(gc.is_tracked(s) or gc.is_tracked(s.key) for s in slots)
        assert not any(gc.is_tracked(k) or gc.is_tracked(s) for k, s in t._index.items())
        # The chunk's records as offsets: nothing for a collection to follow (a set of them: eight slots).
        (group,) = t._shards[0].by_chunk.values()
        assert len(group) == 8 and not [r for r in gc.get_referents(group) if not isinstance(r, type)]
    a, b = key(1), key(1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1 and a != key(2)
    s1, s2 = Slot(0, 4096, 4096, a, 1, 64, None, 0), Slot(0, 4096, 4096, a, 1, 64, None, 0)
    assert s1 == s1 and s1 != s2 and len({s1, s2}) == 2  # by identity: a chunk's records are a set


def test_submit_with_timeout_waits_for_room_instead_of_dropping(ssd_dir):
    faults = Faults(write_delay=0.05)
    with make(ssd_dir, shards=1, capacity=128 << 20, backend=FaultyBackend(UringBackend(), faults),
              max_pending_bytes=33 << 20) as t:
        big = segment(0, n=4 << 20)  # four fit in the staging bound at a time
        assert all(t.submit(key(i), big, timeout=30.0) for i in range(12))
        t.flush()
        s = t.snapshot()
        assert s.write_dropped_total == 0 and s.objects == 12


@pytest.mark.parametrize("throttle", [True, False])
def test_writeback_yields_to_demand_reads(ssd_dir, throttle):
    """While a demand read is in progress, the lane keeps at most ``write_bytes_while_reading`` bytes of
    writes in flight (at least one write), still drains, and goes back to its full depth afterwards."""
    rec = record_length(len(segment(0)))
    cap = 2 * rec
    with make(ssd_dir, shards=1, write_queue_depth=32, demand_holdoff=0.0,
              write_bytes_while_reading=cap if throttle else None) as t:
        t.submit(key(0), segment(0), timeout=5.0)
        t.flush()
        in_read, release = threading.Event(), threading.Event()

        def sink(i: int, seg: bytes) -> None:
            in_read.set()
            assert release.wait(10.0)

        reader = threading.Thread(target=lambda: t.read_many([key(0)], sink=sink))
        reader.start()
        peak, watching = [0], threading.Event()

        def watch() -> None:
            while not watching.is_set():
                peak[0] = max(peak[0], t.snapshot().write_inflight_bytes)
                # Hands the GIL over: without it this loop re-takes the tier's lock before a waiting submitter
                # wakes (Python's locks are not fair), and on a 2-core AMD EPYC VM 199 submits took 18 s, past
                # the sink's wait, so the read ended and the throttle with it. Still samples every few us: an
                # unthrottled lane shows its full depth (655,360 bytes) here.
                time.sleep(0)

        watcher = threading.Thread(target=watch)
        try:
            assert in_read.wait(5.0)
            watcher.start()
            # Queue every write before anyone drives the ring, so the lane has more queued than the
            # throttle lets through however fast this file system completes them.
            with t._ring_lock:
                for i in range(1, 200):
                    assert t.submit(key(i), segment(i))
            t.flush(timeout=20.0)  # throttled, not stopped: the lane drains while the read is held
            held = t.snapshot().write_held_for_reads_total
        finally:
            watching.set()
            release.set()
            reader.join()
            if watcher.is_alive():
                watcher.join()
        peak = peak[0]
        if throttle:
            assert peak <= cap and held > 0
        else:
            assert held == 0
        # The read is over (no hold-off): the lane is unthrottled again.
        for i in range(200, 260):
            assert t.submit(key(i), segment(i), timeout=5.0)
        t.flush(timeout=20.0)
        assert t.snapshot().write_held_for_reads_total == held
        assert t.snapshot().objects == 260 and t.snapshot().write_inflight_bytes == 0


def test_throttle_config_errors(ssd_dir):
    with pytest.raises(SsdConfigError):
        make(ssd_dir, write_bytes_while_reading=-1)
    with pytest.raises(SsdConfigError):
        make(ssd_dir, demand_holdoff=float("nan"))


def test_large_records_stage_in_huge_pages(ssd_dir):
    """Records over 32 KiB are staged in huge-page buffers (classes below 2 MiB carved from a 2 MiB
    page, larger ones whole huge pages); they write and read back intact, and their buffers return to the
    pool as the size class they are."""
    sizes = [20_000, 300_000, 700_000, 1_200_000]  # float16: carved classes, then whole huge pages
    with make(ssd_dir, shards=1, capacity=64 << 20) as t:
        segs = {key(i): segment(i, n=n) for i, n in enumerate(sizes * 2)}
        for k, v in segs.items():
            assert t.submit(k, v, timeout=5.0)
        t.flush()
        assert t.read_many(list(segs)) == list(segs.values())
        pool = t._staging
        a = pool.host(600_000)
        assert isinstance(a.obj, ctypes.Array) and len(a.obj) == size_class(600_000) == 640 << 10
        assert len(a) == 600_000
        pool.recycle(a)
        assert pool.host(640_000).obj is a.obj  # the same class
        big = pool.host(2_200_000)
        assert isinstance(big.obj, mmap.mmap) and len(big.obj) == 4 << 20
        small = pool.host(70_000)
        assert isinstance(small.obj, ctypes.Array) and len(small.obj) == 72 << 10
        assert isinstance(pool.host(20_000).obj, mmap.mmap)  # small classes: plain 4 KiB pages
        # A 32 KiB segment's record (36 KiB) is carved from a huge page, as it was in a 64 KiB class.
        rec = pool.host(record_length((32 << 10) + 64))
        assert isinstance(rec.obj, ctypes.Array) and len(rec.obj) == 36 << 10


def test_staging_classes_are_pages_close_above_the_size():
    """A staging class holds its size in whole 4 KiB pages, at most 1/8 above it (or one page, for the
    smallest) below 2 MiB, whole 2 MiB huge pages from there; classes grow with the size. Powers of two
    staged a 32 KiB segment's record in 64 KiB and a 512 KiB one's in 1 MiB."""
    last = 0
    for n in sorted([1, 4095, 4096, 4097, 36_864, 36_865, 65_536, 65_537, 532_480, 544_768, (2 << 20) - 1,
                     2 << 20, (2 << 20) + 1, 33 << 20] + list(range(1, 3 << 20, 7919))):
        c = size_class(n)
        assert c >= n and c % 4096 == 0 and c >= last, n
        if n < 2 << 20:
            assert c - n < max(n / 8, 4096), n
        else:
            assert c % (2 << 20) == 0 and c - n < 2 << 20, n
        last = c
    assert size_class(record_length(32 << 10)) == record_length(32 << 10)  # a 32 KiB segment: no waste
