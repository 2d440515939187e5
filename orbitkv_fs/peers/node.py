"""One Manager's peer layer: its Transfer Engine, its peer server and its peer client, wired together.

Owns the order of start and stop: the engine starts, the Manager's arena is registered with it, the
server starts answering, the client becomes the Manager's peer fetcher; :meth:`PeerNode.close` undoes
that in reverse (the fetcher is detached before anything it uses closes). Primitive: :class:`PeerNode`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable

from .client import PeerClient, PeerConfig
from .server import PeerServer, PeerSource
from .stats import PeerStats
from .transport import Transport

__all__ = ["PeerNode"]


class PeerNode:
    """Peer sharing for ``manager`` (an :class:`orbitkv_fs.manager.Manager` or any :class:`PeerSource`
    with ``set_peer_fetcher``). ``host`` is this host's address as peers reach it (both the Transfer
    Engine and the control socket bind there); ``port`` 0 picks a free control port."""

    def __init__(self, manager: Any, *, host: str = "127.0.0.1", port: int = 0, peers: Iterable[str] = (),
                 config: PeerConfig | None = None, protocol: str = "tcp", device: str = "",
                 lease_ttl_s: float = 60.0, namespaces: Callable[[], Collection[bytes]] | None = None) -> None:
        self.manager: PeerSource = manager
        self.transport = Transport(host, protocol=protocol, device=device)
        arena = manager.arena_info()
        self.transport.register(int(arena.base_address), int(arena.size))
        self.server = PeerServer(manager, self.transport.session_id, host=host, port=port,
                                 lease_ttl_s=lease_ttl_s, namespaces=namespaces)
        self.client = PeerClient(self.transport, config)
        for address in peers:
            self.client.add_peer(address, static=True)
        if hasattr(manager, "set_peer_fetcher"):
            manager.set_peer_fetcher(self.client)
        self._arena_address = int(arena.base_address)

    @property
    def address(self) -> str:
        """This Manager's peer control address: what other Managers pass as ``--peer``."""
        return self.server.address

    def stats(self) -> PeerStats:
        c = self.client.counters
        s = self.server.counters
        size, used = self.client.staging
        return PeerStats(
            session_id=self.transport.session_id, address=self.address,
            lookups_total=c.lookups, keys_requested_total=c.keys_requested, keys_fetched_total=c.keys_fetched,
            fetched_bytes_total=c.fetched_bytes, misses_total=c.misses, failures_total=dict(c.failures),
            fetch_seconds_total=c.fetch_seconds, hit_latency_buckets=list(c.hit_buckets),
            hit_latency_seconds_sum=c.hit_seconds_sum, hit_latency_count=c.hit_count,
            staging_bytes=size, staging_used_bytes=used, abandoned_reads=self.client.abandoned_reads,
            served_lease_requests_total=s.lease_requests, served_keys_requested_total=s.keys_requested,
            served_keys_total=s.keys_served, served_bytes_total=s.bytes_leased,
            served_refusals_total=dict(s.refused), served_leases_active=self.server.leases_active,
            served_leases_expired_total=s.leases_expired, peers=self.client.peers())

    def close(self) -> None:
        if hasattr(self.manager, "set_peer_fetcher"):
            self.manager.set_peer_fetcher(None)
        self.server.close()
        self.client.close()
        self.transport.unregister(self._arena_address)
