"""One Manager's peer layer: its Transfer Engine, its peer server and its peer client, wired together.

Owns the order of start and stop: the engine starts, the Manager's arena is registered with it, the
server starts answering, the client becomes the Manager's peer fetcher; :meth:`PeerNode.close` undoes
that in reverse (the fetcher is detached before anything it uses closes). Primitives: :class:`PeerNode`,
and for ``orbitkv-cache-manager``: :func:`add_peer_arguments` (the ``--peer*`` flags), :func:`peer_secret`
(the shared secret: ``--peer-secret-file`` or ``$ORBITKV_PEER_SECRET``) and :func:`start_from_args` (a node
when peer sharing is asked for, else None; a non-loopback ``--peer-host`` without a secret is refused, as a
non-loopback HTTP address without an admin token is).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Collection, Iterable

from ..access import MIN_TOKEN_LENGTH, InsecureBind, is_loopback
from .client import PeerClient, PeerConfig
from .server import MAX_CONNECTIONS, PeerServer, PeerSource
from .stats import PeerStats
from .transport import Transport

__all__ = ["PeerNode", "add_peer_arguments", "peer_secret", "start_from_args"]

log = logging.getLogger(__name__)


class PeerNode:
    """Peer sharing for ``manager`` (an :class:`orbitkv_fs.manager.Manager` or any :class:`PeerSource`
    with ``set_peer_fetcher``). ``host`` is this host's address as peers reach it (both the Transfer
    Engine and the control socket bind there); ``port`` 0 picks a free control port."""

    def __init__(self, manager: Any, *, host: str = "127.0.0.1", port: int = 0, peers: Iterable[str] = (),
                 config: PeerConfig | None = None, protocol: str = "tcp", device: str = "",
                 lease_ttl_s: float = 60.0, namespaces: Callable[[], Collection[bytes]] | None = None,
                 secret: bytes | None = None, max_connections: int = MAX_CONNECTIONS) -> None:
        self.manager: PeerSource = manager
        self.transport = Transport(host, protocol=protocol, device=device)
        arena = manager.arena_info()
        self.transport.register(int(arena.base_address), int(arena.size))
        self.server = PeerServer(manager, self.transport.session_id, host=host, port=port,
                                 lease_ttl_s=lease_ttl_s, namespaces=namespaces, secret=secret,
                                 max_connections=max_connections)
        self.client = PeerClient(self.transport, config, secret=secret)
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
            fetch_seconds_total=c.fetch_seconds, hit_latency=c.hit_latency.snapshot(),
            staging_bytes=size, staging_used_bytes=used, abandoned_reads=self.client.abandoned_reads,
            served_lease_requests_total=s.lease_requests, served_keys_requested_total=s.keys_requested,
            served_keys_total=s.keys_served, served_bytes_total=s.bytes_leased,
            served_refusals_total=dict(s.refused), served_leases_active=self.server.leases_active,
            served_leases_expired_total=s.leases_expired, served_connections=self.server.connections,
            served_connections_closed_total=self.server.connections_closed, peers=self.client.peers())

    def close(self) -> None:
        if hasattr(self.manager, "set_peer_fetcher"):
            self.manager.set_peer_fetcher(None)
        self.server.close()
        self.client.close()
        self.transport.unregister(self._arena_address)


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--peer*`` flags of ``orbitkv-cache-manager``."""
    g = parser.add_argument_group("peers (Mooncake Transfer Engine)")
    g.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a peer Manager's peer port (repeatable); enables peer sharing")
    g.add_argument("--peer-port", type=int, default=0,
                   help="this Manager's peer control port (enables peer sharing; default: a free port "
                        "when --peer is given, else peer sharing is off)")
    g.add_argument("--peer-host", default="127.0.0.1",
                   help="address peers reach this host at (Transfer Engine and peer port bind there)")
    g.add_argument("--peer-protocol", default="tcp", help="Transfer Engine protocol: tcp, rdma, efa")
    g.add_argument("--peer-device", default="",
                   help="Transfer Engine devices (RDMA NICs), comma-separated (default: none, for tcp)")
    g.add_argument("--peer-budget-ms", type=float, default=500.0, help="time budget of one peer fetch")
    g.add_argument("--peer-fanout", type=int, default=4, help="peers asked in parallel per fetch")
    g.add_argument("--peer-staging-size", type=int, default=256 << 20,
                   help="bytes of registered memory peer reads land in before verification")
    g.add_argument("--peer-max-connections", type=int, default=MAX_CONNECTIONS,
                   help="connections the peer port keeps open at most: past it the oldest that never carried a "
                        f"valid request is shut down (default {MAX_CONNECTIONS})")
    g.add_argument("--peer-secret-file", default=None, metavar="PATH",
                   help="file holding the secret every peer Manager shares (default: $ORBITKV_PEER_SECRET); "
                        "control messages without its tag are dropped. Required with a non-loopback --peer-host")


def peer_secret(args: argparse.Namespace) -> bytes | None:
    """The shared peer secret (``--peer-secret-file``, else ``$ORBITKV_PEER_SECRET``), or None. Raises
    :class:`~orbitkv_fs.access.InsecureBind` for one shorter than the admin token's minimum."""
    path = getattr(args, "peer_secret_file", None)
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"--peer-secret-file {path}: {e.strerror}") from None
    else:
        secret = os.environ.get("ORBITKV_PEER_SECRET", "").strip().encode()
    if secret and len(secret) < MIN_TOKEN_LENGTH:
        raise InsecureBind(f"the peer secret must be at least {MIN_TOKEN_LENGTH} bytes")
    return secret or None


def start_from_args(manager: Any, args: argparse.Namespace) -> "PeerNode | None":
    """A :class:`PeerNode` for ``manager`` when ``--peer`` or ``--peer-port`` was given, else None."""
    if not args.peer and not args.peer_port:
        return None
    if (args.peer_budget_ms <= 0 or args.peer_fanout < 1 or args.peer_staging_size < (1 << 20)
            or args.peer_max_connections < 1):
        raise ValueError("--peer-budget-ms must be > 0, --peer-fanout >= 1, --peer-staging-size >= 1 MiB, "
                         "--peer-max-connections >= 1")
    secret = peer_secret(args)
    if secret is None:
        if not is_loopback(args.peer_host):
            raise InsecureBind(f"refusing to serve the peer port on non-loopback address {args.peer_host!r} without "
                               "a peer secret; pass --peer-secret-file or set ORBITKV_PEER_SECRET")
        log.warning("peers: no peer secret: any local process may lease from this Manager's arena "
                    "(see docs/security.md)")
    node = PeerNode(manager, host=args.peer_host, port=args.peer_port, peers=args.peer,
                    protocol=args.peer_protocol, device=args.peer_device, secret=secret,
                    config=PeerConfig(budget_s=args.peer_budget_ms / 1000, fanout=args.peer_fanout,
                                      staging_bytes=args.peer_staging_size),
                    max_connections=args.peer_max_connections)
    log.info("peers: control %s, transfer engine %s (%s), %d static peer(s)", node.address,
             node.transport.session_id, args.peer_protocol, len(args.peer))
    return node
