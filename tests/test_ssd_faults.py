"""Faults under the SSD tier, on real files and real io_uring: flipped bytes in the payload, the segment
header and the record header; EIO and ENOSPC from the backend on writes and reads; a slow writeback lane.
Each time: the tier keeps serving, a corrupt record is a miss, nothing else is lost, counters say so."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import threading

import numpy as np

import pytest

from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.faults import FaultyBackend, Faults
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE
from orbitkv_fs.tiers.ssd.uring import SsdIoError, UringBackend
from polling import wait_until
from test_ssd_common import direct_io_dir, flip, key, segment

N = 24


@pytest.fixture
def tier(tmp_path):
    d = direct_io_dir(tmp_path)
    faults = Faults()
    t = SsdTier(SsdConfig(paths=(str(d / "a.okv"), str(d / "b.okv")), capacity=32 << 20),
                backend=FaultyBackend(UringBackend(), faults))
    t.faults = faults
    for i in range(N):
        assert t.submit(key(i), segment(i))
    t.flush()
    yield t
    t.close()


def _where(t: SsdTier, k):
    o = next(o for o in t.iter_records() if o.key == k)
    return t.config.paths[o.shard], o.offset


@pytest.mark.parametrize("part,delta", [
    ("payload", RECORD_HEADER_SIZE + 64 + 1000),
    ("segment header", RECORD_HEADER_SIZE + 20),
    ("record header", 50),
    ("record header crc", RECORD_HEADER_SIZE - 2),
])
def test_flipped_byte_is_a_miss_only_for_that_record(tier, part, delta):
    victim = key(5)
    path, off = _where(tier, victim)
    flip(path, off + delta)
    # Read among its neighbours (records end to end on disk come in by one I/O): only the victim misses.
    assert tier.read_many([key(i) for i in range(N)]) == [None if i == 5 else segment(i) for i in range(N)]
    assert not tier.contains(victim)  # that generation is hidden at once
    s = tier.snapshot()
    assert s.corrupt_records_total == 1 and s.objects == N - 1
    others = [key(i) for i in range(N) if i != 5]
    assert tier.read_many(others) == [segment(i) for i in range(N) if i != 5]
    assert tier.snapshot().corrupt_records_total == 1
    # Republishing the key repairs it.
    assert tier.submit(victim, segment(5))
    tier.flush()
    assert tier.read(victim) == segment(5)


def test_corrupt_record_under_other_readers_lease_is_reclaimed_after(tier):
    victim = key(3)
    path, off = _where(tier, victim)
    flip(path, off + RECORD_HEADER_SIZE + 64 + 5)
    tier.faults.read_delay = 0.3
    import threading

    got = []
    th = [threading.Thread(target=lambda: got.append(tier.read(victim))) for _ in range(3)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    assert got == [None, None, None]
    s = tier.snapshot()
    assert s.corrupt_records_total >= 1 and s.objects == N - 1
    tier.faults.read_delay = 0.0


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_write_errors_publish_nothing_and_are_counted(tier, code):
    tier.faults.write_errno, tier.faults.write_errors = code, 3
    new = [key(100 + i) for i in range(6)]
    for i, k in enumerate(new):
        assert tier.submit(k, segment(100 + i))
    tier.flush()
    s = tier.snapshot()
    assert s.write_errors_total == 3 and s.objects == N + 3
    assert s.errors_by_errno == {errno.errorcode[code]: 3}
    assert tier.stats()[f"ssd_io_errors_{errno.errorcode[code].lower()}_total"] == 3.0
    assert sum(tier.contains(k) for k in new) == 3
    assert tier.read_many([key(i) for i in range(N)]) == [segment(i) for i in range(N)]
    # The failed records' ring space is reusable: the lane keeps working.
    assert tier.submit(new[0], segment(100))
    tier.flush()
    assert tier.read(new[0]) == segment(100)


def test_read_eio_is_a_miss_that_invalidates_nothing(tier):
    tier.faults.read_errno, tier.faults.read_errors = errno.EIO, 1
    assert tier.read(key(1)) is None
    s = tier.snapshot()
    assert s.read_errors_total == 1 and s.corrupt_records_total == 0
    assert tier.contains(key(1)) and tier.read(key(1)) == segment(1)


@pytest.mark.parametrize("errors", [1, 3])
def test_read_eio_of_records_read_together_reads_them_again_one_by_one(tier, errors):
    """Records that lie end to end on disk are read by one I/O. A disk fails the whole request for one bad
    block, so the records of a failed read are read again one by one: an error that does not come again
    (one injected) costs nothing; one that does (three: both shards' runs, then the first record's own read)
    is a miss of that record alone, counted, none corrupt, nothing invalidated, and the next read serves it."""
    keys = [key(i) for i in range(N)]
    tier.faults.read_errno, tier.faults.read_errors = errno.EIO, errors
    got = tier.read_many(keys)
    missed = [i for i, g in enumerate(got) if g is None]
    assert len(missed) == (errors > 1)
    assert all(got[i] == segment(i) for i in range(N) if i not in missed)
    s = tier.snapshot()
    assert s.read_errors_total == len(missed) and s.corrupt_records_total == 0
    assert s.errors_by_errno == ({"EIO": 1} if missed else {})
    assert tier.read_many(keys) == [segment(i) for i in range(N)]


def test_prefetch_eio_of_records_read_together_misses_each_and_invalidates_none(tier):
    """The prefetch lane reads records that lie end to end on disk by one I/O too: one injected EIO is a miss
    of every record of that read (more than one), none corrupt, their leases given back; a later prefetch
    serves them all. A lane reading a record per I/O misses one record; one that counts a read per record
    where records of two shards interleave in its queue, at most the ring's depth of them."""
    keys = [key(i) for i in range(N)]
    shards = {o.key: o.shard for o in tier.iter_records()}
    tier.faults.read_errno, tier.faults.read_errors = errno.EIO, 1
    got: dict = {}
    assert tier.prefetch(keys, lambda k, seg: got.__setitem__(k, bytes(seg))) == N
    assert wait_until(lambda: tier.snapshot().prefetch_read_total + tier.snapshot().prefetch_errors_total == N)
    missed = [k for k in keys if k not in got]
    s = tier.snapshot()
    # the first read prepped is one shard's whole run of records (the shards' records interleave in the queue)
    assert missed and len({shards[k] for k in missed}) == 1
    assert len(missed) == sum(1 for k in keys if shards[k] == shards[missed[0]]) > 1
    assert s.prefetch_errors_total == len(missed) and s.corrupt_records_total == 0
    assert s.errors_by_errno == {"EIO": len(missed)}
    assert all(got[k] == segment(i) for i, k in enumerate(keys) if k in got)
    assert all(sl.leases == 0 for sh in tier._shards for sl in sh.slots.values())
    assert tier.prefetch(missed, lambda k, seg: got.__setitem__(k, bytes(seg))) == len(missed)
    assert wait_until(lambda: len(got) == N)
    assert got == {k: segment(i) for i, k in enumerate(keys)}


def test_slow_writeback_never_delays_demand_reads(tier):
    tier.faults.write_delay = 1.0
    for i in range(8):
        tier.submit(key(200 + i), segment(200 + i))
    assert tier.read_many([key(i) for i in range(N)]) == [segment(i) for i in range(N)]
    # The reads finished while the lane still held its writes: they did not queue behind them. And the
    # writes are not published before they completed (readers get the submitted bytes meanwhile).
    assert key(200) not in {o.key for o in tier.iter_records()}
    assert tier.contains(key(200)) and tier.read(key(200)) == segment(200)
    assert tier.snapshot().writing_bytes > 0
    tier.flush()
    assert all(tier.contains(key(200 + i)) for i in range(8))


class _FailOnceSubmit:
    """A real ring whose next ``submit`` fails (an io_uring_enter error) before reaching the kernel: the
    writes prepped for it stay in the ring, unsubmitted."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.fail = False
        self.eventfd = inner.eventfd

    def submit(self) -> None:
        if self.fail:
            self.fail = False
            raise SsdIoError("io_uring_enter: injected")
        self._inner.submit()

    def submit_and_wait(self, timeout=None):
        if self.fail:
            self.fail = False
            raise SsdIoError("io_uring_enter: injected")
        return self._inner.submit_and_wait(timeout)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _FailOnceBackend:
    def __init__(self) -> None:
        self._inner = UringBackend()
        self.name = "fail-once"
        self.rings: list[_FailOnceSubmit] = []
        self.fail_next_ring = False  # the next ring made fails its first submit

    def open(self, path: str, size: int, *, truncate: bool) -> int:
        return self._inner.open(path, size, truncate=truncate)

    def ring(self, entries: int) -> _FailOnceSubmit:
        r = _FailOnceSubmit(self._inner.ring(entries))
        r.fail, self.fail_next_ring = self.fail_next_ring, False
        self.rings.append(r)
        return r

    def close(self) -> None:
        self._inner.close()


def test_writes_left_in_the_ring_by_a_failed_submit_still_complete(tmp_path):
    """io_uring_enter failing after writes were started: they are submitted again on the lane's next
    round (they stayed prepped in the ring), so flush and close do not wait for them forever."""
    d = direct_io_dir(tmp_path)
    backend = _FailOnceBackend()
    t = SsdTier(SsdConfig(paths=(str(d / "a.okv"),), capacity=32 << 20), backend=backend)
    try:
        backend.rings[0].fail = True  # the writeback ring: the first ring the tier opens
        assert t.submit(key(1), segment(1), timeout=1.0)
        t.flush(timeout=5.0)
        assert t.read(key(1)) == segment(1)
        assert t.snapshot().write_completed_total == 1
    finally:
        closer = threading.Thread(target=t.close, daemon=True)
        closer.start()
        closer.join(10.0)
        assert not closer.is_alive(), "close() waits for writes that were never submitted"


def test_close_waits_for_a_submitter_driving_the_writeback_ring(tmp_path):
    """A flush_dram submitter can be in its round on the writeback ring while the Manager shuts down: close()
    waits for that round before closing the ring, and a later round does not touch the closed ring."""
    t = SsdTier(SsdConfig(paths=(str(direct_io_dir(tmp_path) / "a.okv"),), capacity=32 << 20))
    assert t.submit(key(1), segment(1), timeout=1.0)
    t.flush(timeout=5.0)
    t._ring_lock.acquire()  # a submitter in the middle of its round
    closer = threading.Thread(target=t.close, daemon=True)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() closed the ring under a submitter's round"
    t._ring_lock.release()
    closer.join(10.0)
    assert not closer.is_alive()
    t._pump()  # the submitter's next round: nothing to drive, no error from the closed ring


@contextlib.contextmanager
def _stored_tier(tmp_path, backend, n: int = 4):
    """A tier on ``backend`` holding ``n`` flushed segments: ``(tier, keys)``; closed after."""
    d = direct_io_dir(tmp_path)
    t = SsdTier(SsdConfig(paths=(str(d / "a.okv"),), capacity=32 << 20), backend=backend)
    try:
        keys = [key(i) for i in range(n)]
        for i, k in enumerate(keys):
            assert t.submit(k, segment(i), timeout=1.0)
        t.flush(timeout=5.0)
        yield t, keys
    finally:
        t.close()


def test_prefetch_lane_that_fails_to_submit_gives_back_its_leases_and_restarts(tmp_path):
    """The prefetch lane's io_uring_enter failing ends that lane: the keys it held are dropped (counted as
    errors), their record leases are given back, and the next prefetch starts a new lane that serves them."""
    backend = _FailOnceBackend()
    with _stored_tier(tmp_path, backend) as (t, keys):
        got: dict = {}
        backend.fail_next_ring = True  # the lane's ring (made by its first request)
        assert t.prefetch(keys, lambda k, seg: got.__setitem__(k, bytes(seg))) == 4
        assert wait_until(lambda: t.snapshot().prefetch_errors_total >= 4), t.snapshot()
        assert got == {}
        assert t.prefetch(keys, lambda k, seg: got.__setitem__(k, bytes(seg))) == 4  # nothing left behind as "queued"
        assert wait_until(lambda: len(got) >= 4), t.snapshot()
        assert got == {k: segment(i) for i, k in enumerate(keys)}
        # No lease stays on the records (the ring may reuse their space).
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values())


def test_demand_read_whose_submit_fails_raises_and_leaves_no_reads_in_the_ring(tmp_path):
    """io_uring_enter failing under a demand read: the read raises (no wait for reads the kernel never
    got), its leases are given back, and the ring with those prepped reads is not handed to the next
    reader (whose submit would send them, into buffers already dropped, under tags it reuses)."""
    backend = _FailOnceBackend()
    with _stored_tier(tmp_path, backend) as (t, keys):
        backend.fail_next_ring = True  # the first read ring
        result: list = []

        def read() -> None:
            try:
                result.append(t.read_many(keys))
            except SsdIoError as e:
                result.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10.0)
        assert not reader.is_alive(), "read_many waits for reads that were never submitted"
        assert isinstance(result[0], SsdIoError)
        assert t.read_many(keys[::-1]) == [segment(i) for i in range(4)][::-1]
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values())  # no lease stays


def _corrupt(path: str, rng, before: bytes) -> str:
    """One natural corruption of a shard file: a flipped byte, a zeroed block, two blocks swapped, a block
    the disk returns from before (``before``: an older image of the file), or the file cut short."""
    size = os.path.getsize(path)
    kind = rng.choice(["flip", "zero", "swap", "stale", "truncate"])
    blk = int(rng.integers(0, size // 4096)) * 4096
    with open(path, "r+b") as f:
        if kind == "flip":
            pos = int(rng.integers(0, size))
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ int(rng.integers(1, 256))]))
        elif kind == "zero":
            f.seek(blk)
            f.write(bytes(4096))
        elif kind == "swap":
            other = int(rng.integers(0, size // 4096)) * 4096
            f.seek(blk)
            x = f.read(4096)
            f.seek(other)
            y = f.read(4096)
            f.seek(blk)
            f.write(y)
            f.seek(other)
            f.write(x)
        elif kind == "stale":
            f.seek(blk)
            f.write(before[blk:blk + 4096])
        else:
            f.truncate(blk)
    return kind


def test_randomized_corruptions_serve_no_wrong_bytes_after_recovery(tmp_path):
    """Rounds of random writes (several versions per key, invalidations, a ring that wraps), a clean close,
    then 1-4 natural corruptions of the file: a recovered tier serves each key only its newest version,
    nothing invalidated since, and a recovered key reads back byte for byte (or is a miss)."""
    rng = np.random.default_rng(2026)
    d = direct_io_dir(tmp_path)
    kinds: collections.Counter = collections.Counter()
    served = 0
    for round_ in range(60):
        path = str(d / f"r{round_}.okv")
        newest: dict = {}
        with SsdTier(SsdConfig(paths=(path,), capacity=1 << 20)) as t:
            before = b""
            for step in range(int(rng.integers(40, 140))):
                i = int(rng.integers(0, 24))
                if rng.random() < 0.08:
                    gone = [key(j) for j in range(24) if rng.random() < 0.3]
                    t.invalidate(keys=gone)
                    for k in gone:
                        newest.pop(k, None)
                    continue
                v = int(rng.integers(0, 1000))
                blob = segment(i, n=int(rng.integers(16, 12000)), version=v)
                if t.submit(key(i), blob, timeout=5.0):
                    newest[key(i)] = blob
                if step == 30:
                    t.flush()
                    with open(path, "rb") as f:
                        before = f.read()
            t.flush()
        before = before or open(path, "rb").read()
        for _ in range(int(rng.integers(1, 5))):
            kinds[_corrupt(path, rng, before)] += 1
        with SsdTier(SsdConfig(paths=(path,), capacity=1 << 20, recover=True)) as t:
            keys = [key(i) for i in range(24)]
            for k, got in zip(keys, t.read_many(keys)):
                if got is not None:
                    served += 1
                    assert newest.get(k) == got, f"round {round_}: {k} served bytes that are not its newest version"
        os.unlink(path)
    assert served > 200 and all(kinds[k] > 5 for k in ("flip", "zero", "swap", "stale", "truncate")), (served, kinds)
