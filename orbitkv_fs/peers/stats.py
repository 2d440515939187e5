"""Peer-sharing counters and their typed snapshot (what ``GET /v1/peers`` and metrics are built from).

Owns :class:`PeerStats` (the snapshot), :class:`PeerInfo` (one configured peer), the requester's
:class:`ClientCounters` and the server's :class:`ServerCounters`. Names follow the Prometheus
convention the server exports them under (``orbitkv_peer_`` prefix added there, units in names,
counters end in ``_total``). Failure reasons are the :class:`FailureReason` strings.

Invariant: counters only grow; a snapshot is taken under the owner's lock and is immutable.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

__all__ = ["ClientCounters", "FailureReason", "LATENCY_BUCKETS_S", "PeerInfo", "PeerStats", "ServerCounters"]

#: Upper bounds (seconds) of the remote-hit latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class FailureReason:
    TIMEOUT = "timeout"  # no answer, or the read did not finish, within the budget
    UNREACHABLE = "unreachable"  # the Transfer Engine could not reach the peer's session
    TRANSFER = "transfer"  # a read failed (peer died, extent rejected)
    CHECKSUM = "checksum"  # header or CRC32C of the fetched bytes did not verify
    NAMESPACE = "namespace"  # the peer refused our namespace, or answered for another one
    PROTOCOL = "protocol"  # an undecodable or inconsistent reply
    REFUSED = "refused"  # the peer refused for another reason (busy, version, bad request)
    STAGING = "staging"  # no room in local staging memory or the arena (not counted against the peer)


class PeerInfo(msgspec.Struct, frozen=True):
    id: str  # "host:port" of the peer's control socket
    address: str
    session_id: str  # the peer's Transfer Engine session ("" until it answered once)
    state: str  # "ok" | "backoff"
    consecutive_failures: int
    backoff_remaining_s: float
    requests_total: int
    keys_fetched_total: int
    fetched_bytes_total: int
    failures_total: dict[str, int]
    static: bool  # configured with --peer at start (False: registered at run time)


class PeerStats(msgspec.Struct, frozen=True):
    """Requester and server counters of one Manager's peer layer."""

    session_id: str
    address: str  # this Manager's peer control address
    lookups_total: int  # fetch calls that asked at least one peer
    keys_requested_total: int
    keys_fetched_total: int  # verified segments handed to the Manager
    fetched_bytes_total: int
    misses_total: int  # requested keys no peer delivered
    failures_total: dict[str, int]  # reason -> count (per peer and request)
    fetch_seconds_total: float
    #: Remote-hit latency histogram: counts per LATENCY_BUCKETS_S bound, then +Inf (not cumulative).
    hit_latency_buckets: list[int]
    hit_latency_seconds_sum: float
    hit_latency_count: int
    staging_bytes: int
    staging_used_bytes: int
    abandoned_reads: int  # reads given up at the deadline, still owned by the engine
    served_lease_requests_total: int
    served_keys_requested_total: int
    served_keys_total: int
    served_bytes_total: int
    served_refusals_total: dict[str, int]
    served_leases_active: int
    served_leases_expired_total: int
    peers: list[PeerInfo]


@dataclass
class ClientCounters:
    lookups: int = 0
    keys_requested: int = 0
    keys_fetched: int = 0
    fetched_bytes: int = 0
    misses: int = 0
    failures: Counter = field(default_factory=Counter)
    fetch_seconds: float = 0.0
    hit_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    hit_seconds_sum: float = 0.0
    hit_count: int = 0

    def observe_hit(self, seconds: float) -> None:
        i = 0
        while i < len(LATENCY_BUCKETS_S) and seconds > LATENCY_BUCKETS_S[i]:
            i += 1
        self.hit_buckets[i] += 1
        self.hit_seconds_sum += seconds
        self.hit_count += 1


@dataclass
class ServerCounters:
    lease_requests: int = 0
    keys_requested: int = 0
    keys_served: int = 0
    bytes_leased: int = 0
    releases: int = 0
    prefix_requests: int = 0
    leases_expired: int = 0
    refused: Counter = field(default_factory=Counter)
