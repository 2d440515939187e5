"""Serving side of peer sharing: answers other Managers' lease, release and prefix requests.

Owns a ZeroMQ ROUTER socket (one thread) at the peer port and the leases it took on behalf of peers.
Primitives: :class:`PeerSource` (what it needs from the Manager: ``lease_objects``, ``release``,
``arena_info``, ``list_engines``) and :class:`PeerServer`.

Invariants:

* Only keys of the request's namespace, and only namespaces this Manager serves (one of its engines'),
  are ever leased; anything else is a :class:`~orbitkv_fs.peers.protocol.Refused` reply, never bytes.
* Every extent named in a reply lies inside the registered arena and stays under lease until the
  requester releases it or the lease TTL expires (a requester that died never pins the arena forever).
  After the TTL the extent may be reused; a requester still reading then gets bytes that fail its CRC.
* A malformed frame gets a ``bad_request`` reply (or is dropped when not even a request id can be read);
  it never stops the serving thread.
* With a peer secret, a frame without a valid tag is counted (``unauthenticated``) and never answered or
  acted on; frames over :data:`~orbitkv_fs.peers.protocol.MAX_FRAME_BYTES` are dropped by the socket.
* A connection that sends nothing -- not even the answer to the socket's heartbeat (ZMTP ``PING``, which
  every libzmq peer answers by itself) -- is closed after :data:`HEARTBEAT_TIMEOUT_MS`: libzmq bounds
  neither connections nor idleness, and a process holding connections it completed the handshake of would
  otherwise keep their descriptors for good (docs/security.md).
* At most ``max_connections`` connections stay open (:class:`_Connections`, fed by the socket's monitor): past
  that a connection that never carried a valid request is shut down, the oldest of the remote address holding
  the most of those (the newest when every one did), so a process that keeps talking without the secret holds
  at most that many of the Manager's descriptors, a peer whose request was valid is not the one that goes while
  another has never sent one, and a flood from one address sheds its own connections before a new peer's.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol, Sequence, runtime_checkable

import msgspec

from ..keys import ObjectKey
from . import protocol as P
from .client import PeerError
from .stats import ServerCounters

__all__ = ["PeerServer", "PeerSource"]

log = logging.getLogger(__name__)

#: the peer port's heartbeat: a PING every interval; a connection with no traffic for the timeout is closed
HEARTBEAT_IVL_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 30_000
#: connections the peer port keeps open at most (``--peer-max-connections``)
MAX_CONNECTIONS = 1024


@runtime_checkable
class PeerSource(Protocol):
    """The part of :class:`orbitkv_fs.manager.Manager` a peer server uses."""

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[Any]]: ...

    def release(self, lease_id: int) -> None: ...

    def arena_info(self) -> Any: ...

    def list_engines(self) -> list[Any]: ...


@dataclass
class _Conn:
    ends: tuple  # (local, remote) address: the TCP connection, not just its descriptor number
    valid: bool = False  # a request on it passed the secret and decoded


def _ends(fd: int) -> "tuple | None":
    """``(local, remote)`` address of the TCP socket at descriptor ``fd``; None when it is not one (closed, or
    its number taken by something else since)."""
    try:
        s = socket.socket(fileno=fd)  # no new descriptor: it is detached again below, never closed here
    except OSError:
        return None
    try:
        return s.getsockname(), s.getpeername()
    except OSError:
        return None
    finally:
        s.detach()


def _shut(fd: int, ends: tuple) -> bool:
    """Shut down the TCP connection ``ends`` at descriptor ``fd`` (libzmq then sees it end and closes the
    descriptor itself; closing it here would let its number be reused under libzmq); False when the descriptor
    holds another connection by now."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if (s.getsockname(), s.getpeername()) != ends:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.detach()


def _source_fd(frame: Any) -> int:
    """The descriptor of the connection a received ZeroMQ frame came on; -1 where libzmq no longer tells
    (``ZMQ_SRCFD`` is deprecated there): its connection is then never marked valid, and the cap takes the oldest
    connections first."""
    import zmq

    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError):
        return -1


class _Connections:
    """The peer port's open connections, by descriptor (from the socket monitor's accepted and disconnected
    events, and the source descriptor of each request), and the cap on them: :meth:`enforce` shuts down, while
    more than ``cap`` are open, a connection that never carried a valid request, the oldest of the remote
    address that holds the most of them, the first to reach that count where addresses tie (so a flood from one
    address takes its own connections, not a new peer's from another), and the newest when every one did. Only connections to ``port`` are tracked: a
    descriptor number the monitor names late may already be another socket's."""

    def __init__(self, cap: int, port: int) -> None:
        self.cap, self.port = cap, port
        self.open: dict[int, _Conn] = {}  # in the order they came
        # never-valid connections by remote address, each in the order they came
        self.pending: dict[str, dict[int, None]] = {}
        # the addresses by how many never-valid connections they hold, each in the order it reached that count:
        # the one to shed is found without a pass over every address (a local process can bind many)
        self.by_count: dict[int, dict[str, None]] = {}
        self.closed_total = 0  # shut down for the cap

    def accepted(self, fd: int) -> None:
        self.gone(fd)  # a number seen before: its connection ended, this one is the newest
        ends = _ends(fd)
        if ends is not None and ends[0][1] == self.port:
            self.open[fd] = _Conn(ends)
            mine = self.pending.setdefault(ends[1][0], {})
            self._count(ends[1][0], len(mine), len(mine) + 1)
            mine[fd] = None

    def gone(self, fd: int) -> None:
        c = self.open.pop(fd, None)
        if c is not None and not c.valid:
            self._settle(fd, c)

    def valid(self, fd: int) -> None:
        c = self.open.get(fd)
        if c is not None and not c.valid:
            c.valid = True
            self._settle(fd, c)

    def _settle(self, fd: int, c: _Conn) -> None:
        """``fd`` no longer counts among its address's never-valid connections."""
        addr = c.ends[1][0]
        mine = self.pending[addr]
        del mine[fd]
        self._count(addr, len(mine) + 1, len(mine))
        if not mine:
            del self.pending[addr]

    def _count(self, addr: str, old: int, new: int) -> None:
        if old:
            was = self.by_count[old]
            del was[addr]
            if not was:
                del self.by_count[old]
        if new:
            self.by_count.setdefault(new, {})[addr] = None

    def enforce(self) -> None:
        while len(self.open) > self.cap:
            if self.by_count:  # a pass over the distinct counts only: fewer than sqrt(2 * cap) of them
                addr = next(iter(self.by_count[max(self.by_count)]))
                fd = next(iter(self.pending[addr]))
            else:
                fd = next(reversed(self.open))
            c = self.open[fd]
            self.gone(fd)
            if _shut(fd, c.ends):
                self.closed_total += 1


def _engine_namespaces(source: PeerSource) -> Callable[[], Collection[bytes]]:
    return lambda: {bytes.fromhex(e.namespace) for e in source.list_engines()}


class PeerServer:
    """Serve ``source``'s DRAM arena to peers. ``session_id`` is this process's Transfer Engine, which
    must have the arena registered."""

    def __init__(self, source: PeerSource, session_id: str, *, host: str = "127.0.0.1", port: int = 0,
                 lease_ttl_s: float = 60.0, max_leases: int = 4096,
                 namespaces: Callable[[], Collection[bytes]] | None = None, secret: bytes | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        import zmq  # lazily: the core imports without pyzmq

        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")

        self._source = source
        self._secret = secret
        self._unauth_logged = float("-inf")
        self.session_id = session_id
        self._namespaces = namespaces or _engine_namespaces(source)
        self._ttl = lease_ttl_s
        self._max_leases = max_leases
        info = source.arena_info()
        self._base, self._size = int(info.base_address), int(info.size)
        self._leases: dict[int, float] = {}  # lease id -> expiry (monotonic)
        self._lock = threading.Lock()
        self.counters = ServerCounters()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._close_sockets()
            raise PeerError(f"cannot bind the peer port {host}:{port}: {e}") from None
        self.host, self.port = host, port
        self._conns = _Connections(max_connections, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"orbitkv-peer-server:{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def leases_active(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def connections(self) -> int:
        """Connections open at the peer port, as its monitor last told."""
        return len(self._conns.open)

    @property
    def connections_closed(self) -> int:
        """Connections shut down for the cap, since the start."""
        return self._conns.closed_total

    # -- serving loop ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while not self._stop.is_set():
            if poller.poll(100):
                self._watch()  # connections first: a request's source descriptor must be known to count
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        self.counters.refused[P.RefuseReason.BAD_REQUEST] += 1
                        continue
                    reply = self._handle(frames[1].bytes, _source_fd(frames[1]))
                    if reply is not None:
                        self._sock.send_multipart([frames[0].bytes, P.seal(P.encode(reply), self._secret, P.REPLY)])
            now = time.monotonic()
            if now >= next_sweep:
                self._expire(now)
                next_sweep = now + 1.0

    def _watch(self) -> None:
        """Take the monitor's events (connections accepted and ended) and hold the cap."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._conns.accepted(int(ev["value"]))
            else:
                self._conns.gone(int(ev["value"]))
        self._conns.enforce()

    def _handle(self, frame: bytes, fd: int = -1) -> "P.Reply | None":
        try:
            frame = P.unseal(frame, self._secret, P.REQUEST)
        except P.ProtocolError:
            self.counters.refused[P.RefuseReason.UNAUTHENTICATED] += 1
            now = time.monotonic()
            if now >= self._unauth_logged + 10:
                self._unauth_logged = now
                log.warning("peer port: dropping requests without a valid tag under the peer secret")
            return None
        try:
            req = P.decode_request(frame)
        except P.ProtocolError as e:
            self.counters.refused[P.RefuseReason.BAD_REQUEST] += 1
            req_id = _salvage_req_id(frame)
            return None if req_id is None else P.Refused(req_id, P.RefuseReason.BAD_REQUEST, str(e)[:200])
        self._conns.valid(fd)
        try:
            if isinstance(req, P.LeaseRequest):
                return self._lease(req)
            if isinstance(req, P.ReleaseRequest):
                self._release(req.lease_id)
                return P.Ack(req.req_id)
            return self._prefix(req)
        except Exception as e:  # a Manager error must not stop the serving thread
            log.exception("peer request failed")
            self.counters.refused[P.RefuseReason.BAD_REQUEST] += 1
            return P.Refused(req.req_id, P.RefuseReason.BAD_REQUEST, f"{type(e).__name__}: {e}"[:200])

    def _refuse(self, req_id: int, reason: str, detail: str) -> P.Refused:
        self.counters.refused[reason] += 1
        return P.Refused(req_id, reason, detail)

    def _check(self, req: "P.LeaseRequest | P.PrefixRequest") -> P.Refused | None:
        if req.version != P.PROTOCOL_VERSION:
            return self._refuse(req.req_id, P.RefuseReason.VERSION, f"protocol version {req.version}")
        if req.namespace not in self._namespaces():
            return self._refuse(req.req_id, P.RefuseReason.NAMESPACE,
                                f"namespace {req.namespace.hex()} is not served here")
        return None

    def _lease(self, req: P.LeaseRequest) -> P.Reply:
        refused = self._check(req)
        if refused is not None:
            return refused
        try:
            keys = [ObjectKey.unpack(k) for k in req.keys]
        except ValueError as e:
            return self._refuse(req.req_id, P.RefuseReason.BAD_REQUEST, str(e))
        if any(k.namespace != req.namespace for k in keys):
            return self._refuse(req.req_id, P.RefuseReason.NAMESPACE, "a key names another namespace")
        with self._lock:
            if len(self._leases) >= self._max_leases:
                return self._refuse(req.req_id, P.RefuseReason.BUSY, f"{len(self._leases)} leases outstanding")
        lease_id, extents = self._source.lease_objects(keys)
        out: list[P.Extent | None] = []
        served = 0
        for e in extents:
            if e is None:
                out.append(None)
                continue
            if e.offset < 0 or e.length <= 0 or e.offset + e.length > self._size:
                raise RuntimeError(f"arena extent {e} outside the {self._size}-byte arena")
            out.append(P.Extent(int(e.offset), int(e.length), int(e.generation)))
            served += 1
        if served == 0:
            if lease_id:
                self._source.release(lease_id)
            lease_id = 0
        else:
            with self._lock:
                self._leases[lease_id] = time.monotonic() + self._ttl
        self.counters.lease_requests += 1
        self.counters.keys_requested += len(keys)
        self.counters.keys_served += served
        self.counters.bytes_leased += sum(e.length for e in out if e is not None)
        return P.LeaseReply(req.req_id, req.namespace, self.session_id, self._base, lease_id, out)

    def _release(self, lease_id: int) -> None:
        with self._lock:
            known = self._leases.pop(lease_id, None) is not None
        if known:
            self._source.release(lease_id)
            self.counters.releases += 1

    def _prefix(self, req: P.PrefixRequest) -> P.Reply:
        refused = self._check(req)
        if refused is not None:
            return refused
        count = 0
        for chunk in req.chunks:
            keys = [ObjectKey(req.namespace, chunk, layer, role) for layer, role in req.layers]
            lease_id, extents = self._source.lease_objects(keys)
            if lease_id:
                self._source.release(lease_id)
            if any(e is None for e in extents):
                break
            count += 1
        self.counters.prefix_requests += 1
        return P.PrefixReply(req.req_id, req.namespace, count)

    def _expire(self, now: float) -> None:
        with self._lock:
            dead = [lid for lid, exp in self._leases.items() if exp <= now]
            for lid in dead:
                del self._leases[lid]
        for lid in dead:
            self.counters.leases_expired += 1
            try:
                self._source.release(lid)
            except Exception:  # already gone (the Manager dropped it): nothing left to free
                log.debug("expired lease %d already released", lid)

    def close(self) -> None:
        """Stop serving and release every lease still held for peers."""
        self._stop.set()
        self._thread.join()
        self._close_sockets()
        with self._lock:
            leases, self._leases = list(self._leases), {}
        for lid in leases:
            try:
                self._source.release(lid)
            except Exception:
                log.debug("lease %d already released", lid)

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)


class _ReqId(msgspec.Struct):
    req_id: int


_salvage = msgspec.msgpack.Decoder(_ReqId)


def _salvage_req_id(frame: bytes) -> int | None:
    try:
        return _salvage.decode(frame).req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
