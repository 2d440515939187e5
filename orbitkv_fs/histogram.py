"""Duration histograms: the one bucket layout every OrbitKV-FS latency is counted in.

Primitives:

* :data:`DURATION_BUCKETS_S` -- upper bounds in seconds (100 us to 10 s); the last bucket is +Inf.
* :class:`DurationHistogram` -- the immutable wire snapshot (per-bucket counts, not cumulative; sum; count)
  that stats replies carry and ``/metrics`` turns into a Prometheus histogram.
* :class:`DurationCounter` -- the mutable accumulator behind a snapshot.

Invariants: every histogram has ``len(DURATION_BUCKETS_S) + 1`` buckets and ``count == sum(buckets)``;
an accumulator is not locked (its owner observes and snapshots under its own lock).
"""

from __future__ import annotations

import bisect

import msgspec

__all__ = ["DURATION_BUCKETS_S", "DurationCounter", "DurationHistogram"]

DURATION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0)


class DurationHistogram(msgspec.Struct, frozen=True):
    """Observations per :data:`DURATION_BUCKETS_S` bound, then +Inf (not cumulative)."""

    buckets: list[int]
    sum: float
    count: int


class DurationCounter:
    """Counts durations into :data:`DURATION_BUCKETS_S` buckets."""

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(DURATION_BUCKETS_S) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, n: int = 1) -> None:
        """``n`` observations of ``seconds`` each."""
        # bisect_left: a duration equal to a bound belongs to that bound's bucket (Prometheus' "le").
        self.buckets[bisect.bisect_left(DURATION_BUCKETS_S, seconds)] += n
        self.sum += seconds * n

    def snapshot(self) -> DurationHistogram:
        return DurationHistogram(list(self.buckets), self.sum, sum(self.buckets))
