"""Faults under the SSD tier, on real files and real io_uring: flipped bytes in the payload, the segment
header and the record header; EIO and ENOSPC from the backend on writes and reads; a slow writeback lane.
Each time: the tier keeps serving, a corrupt record is a miss, nothing else is lost, counters say so."""

from __future__ import annotations

import errno

import pytest

from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.faults import FaultyBackend, Faults
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE
from orbitkv_fs.tiers.ssd.uring import UringBackend
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
    assert tier.read(victim) is None
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
