"""Duration histograms: n observations at once equal n single ones; a batch's time spread over segments."""

from __future__ import annotations

import pytest

from orbitkv_fs.histogram import DURATION_BUCKETS_S, DurationCounter
from orbitkv_fs.manager import Manager, ManagerConfig


def test_observe_n_equals_n_single_observations():
    one, many = DurationCounter(), DurationCounter()
    for seconds in (0.0001, 0.0003, 2.0, 20.0):  # on a bound, inside, large, past the last bound
        for _ in range(7):
            one.observe(seconds)
        many.observe(seconds, 7)
    assert one.snapshot() == many.snapshot()
    snap = many.snapshot()
    assert snap.count == 28 and len(snap.buckets) == len(DURATION_BUCKETS_S) + 1
    assert snap.buckets[0] == 7 and snap.buckets[-1] == 7  # 100 us is "le 0.0001"; 20 s is +Inf


def test_batch_time_is_observed_per_segment():
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
        m._add_per_segment("decode_seconds", 0.004, 4)
        st = m.stats()
    assert st.decode_seconds == pytest.approx(0.004)
    h = st.durations["decode"]
    assert h.count == 4 and h.sum == pytest.approx(0.004)
    assert h.buckets[DURATION_BUCKETS_S.index(0.001)] == 4  # four segments of 1 ms each
