"""Peer sharing between Managers: encoded segments move unchanged through the Mooncake Transfer Engine.

``docs/peers.md`` is the user documentation. Modules: :mod:`.transport` (the Transfer Engine, imported
lazily), :mod:`.protocol` (typed control messages), :mod:`.server` (serving leases to peers),
:mod:`.client` (fetching from peers: fan-out, budget, backoff, verification), :mod:`.stats` (counters and
their snapshot), :mod:`.node` (one Manager's peer layer). Importing this package imports neither
``mooncake`` nor ``zmq``; constructing a :class:`Transport`, :class:`PeerServer` or :class:`PeerClient` does.
"""

from .client import ArenaSink, PeerClient, PeerConfig, PeerError, UnknownPeer
from .node import PeerNode
from .protocol import ProtocolError
from .server import PeerServer, PeerSource
from .stats import FailureReason, PeerInfo, PeerStats
from .transport import Transport, TransportError, TransportUnavailable, transport_available

__all__ = [
    "ArenaSink", "FailureReason", "PeerClient", "PeerConfig", "PeerError", "PeerInfo", "PeerNode", "PeerServer",
    "PeerSource", "PeerStats", "ProtocolError", "Transport", "TransportError", "TransportUnavailable",
    "UnknownPeer", "transport_available",
]
