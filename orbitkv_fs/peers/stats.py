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

from ..histogram import DurationCounter, DurationHistogram

__all__ = ["ClientCounters", "FailureReason", "PeerInfo", "PeerStats", "ServerCounters"]


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
    hit_latency: DurationHistogram  # remote hits: request to verified bytes
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
    served_connections: int  # open at the peer port
    served_connections_closed_total: int  # shut down past --peer-max-connections
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
    hit_latency: DurationCounter = field(default_factory=DurationCounter)


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
