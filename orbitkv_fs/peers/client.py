"""Requesting side of peer sharing: fetch missing segments from other Managers.

Owns the peer registry (static ``--peer`` entries and run-time registrations), the per-peer failure
counts and backoff, the staging memory peers' bytes are read into, and the requester's counters.
Primitives: :class:`PeerConfig`, :class:`PeerClient` (``add_peer`` / ``remove_peer`` / ``peers`` /
``fetch`` / ``fetch_into`` / ``lookup_prefix``). ``PeerClient`` is the Manager's
:class:`~orbitkv_fs.manager.PeerFetcher`.

One fetch: ask up to ``fanout`` peers not in backoff, in parallel, to lease the keys (one
:class:`~orbitkv_fs.peers.protocol.LeaseRequest` per peer and namespace); for each key take the first
peer that holds it; read those extents with the Transfer Engine -- into staging memory (:meth:`fetch`,
verified segments are copied out as ``bytes``) or straight into the Manager's arena
(:meth:`fetch_into`: ``reserve``, then ``publish``, which verifies in place; no copy); verify each
segment as its read lands (header, the key's layer and role, CRC32C); release the leases. All of it runs within
``budget_s``; what is not done by then is a miss.

Invariants:

* Nothing that did not verify is returned or published, nor anything from a reply for another namespace.
* Memory a read was submitted into (staging or an arena reservation) is reused only after the Transfer
  Engine reports that read terminal, even when the fetch stopped waiting for it (it is parked until then,
  and a reaper thread gives it back within ``_REAP_INTERVAL_S`` of the engine ending it).
* Every lease a peer granted is released (or left to the peer's TTL when the peer stopped answering,
  or answered after the fetch stopped listening).
* A failure (timeout, unreachable, failed read, bad checksum, namespace, protocol, refusal) counts
  against that peer; when the fetch ends the peer is skipped for an exponentially growing backoff,
  reset by its next clean answer. A peer that simply lacks the keys is not failing.
* A lying peer cannot steer this Manager elsewhere: a reply must carry a valid tag under the peer secret
  (when there is one), frames over :data:`~orbitkv_fs.peers.protocol.MAX_FRAME_BYTES` are dropped by the
  socket, and reads go only to the Transfer Engine on the host this Manager asked (a reply naming another
  host's session is a protocol failure, so a peer cannot turn this Manager's reads on a third host).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..errors import OrbitKVError, SegmentError
from ..keys import ObjectKey
from ..segment import HEADER_SIZE, MAX_STORED_BYTES, parse_segment
from . import protocol as P
from .stats import ClientCounters, FailureReason, PeerInfo
from .transport import READ_DONE, READ_PENDING, Transport, TransportError

__all__ = ["ArenaSink", "PeerClient", "PeerConfig", "PeerError", "UnknownPeer"]

log = logging.getLogger(__name__)
_ALIGN = 64
#: How often the reaper thread asks the engine about parked reads.
_REAP_INTERVAL_S = 0.2
_MAX_EXTENT = HEADER_SIZE + MAX_STORED_BYTES + 4096


class ArenaSink(Protocol):
    """What :meth:`PeerClient.fetch_into` needs of a Manager (:class:`orbitkv_fs.manager.Manager` has it)."""

    def arena_info(self) -> Any: ...

    def reserve(self, nbytes: int) -> Any: ...

    def publish(self, reservation: Any, key: ObjectKey) -> bool: ...

    def abort(self, reservation: Any) -> None: ...

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[Any]]: ...

    def release(self, lease_id: int) -> None: ...


class PeerError(OrbitKVError, ValueError):
    """A bad peer address, or a peer registered twice."""


class UnknownPeer(OrbitKVError, KeyError):
    """No peer with that id."""


@dataclass(frozen=True)
class PeerConfig:
    #: Wall-clock budget of one fetch or prefix lookup: lease round trip, reads and verification.
    budget_s: float = 0.5
    #: Peers asked in parallel per fetch.
    fanout: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    #: Registered memory peers' bytes land in before verification.
    staging_bytes: int = 256 << 20


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PeerError(f"peer address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class _Staging:
    """First-fit allocator over one registered anonymous mapping."""

    def __init__(self, transport: Transport, size: int) -> None:
        self.size = size
        self._mm = mmap.mmap(-1, size)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mm)
        transport.register(self.address, size)
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self.used = 0
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = -(-n // _ALIGN) * _ALIGN
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= n:
                    if ln == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, ln - n)
                    self.used += n
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        n = -(-n // _ALIGN) * _ALIGN
        with self._lock:
            self.used -= n
            fl = self._free
            lo, hi = 0, len(fl)
            while lo < hi:
                mid = (lo + hi) // 2
                if fl[mid][0] < off:
                    lo = mid + 1
                else:
                    hi = mid
            fl.insert(lo, (off, n))
            if lo + 1 < len(fl) and fl[lo][0] + fl[lo][1] == fl[lo + 1][0]:
                fl[lo] = (fl[lo][0], fl[lo][1] + fl[lo + 1][1])
                del fl[lo + 1]
            if lo > 0 and fl[lo - 1][0] + fl[lo - 1][1] == fl[lo][0]:
                fl[lo - 1] = (fl[lo - 1][0], fl[lo - 1][1] + fl[lo][1])
                del fl[lo]

    def close(self, transport: Transport) -> None:
        transport.unregister(self.address)
        self.view.release()
        del self._anchor
        self._mm.close()


class _Peer:
    def __init__(self, address: str, static: bool) -> None:
        self.host, self.port = parse_address(address)
        self.address = address
        self.static = static
        self.session_id = ""
        self.consecutive = 0
        self.backoff_until = 0.0
        self.requests = 0
        self.keys_fetched = 0
        self.fetched_bytes = 0
        self.failures: dict[str, int] = {}
        self.idle: list = []  # DEALER sockets not in use
        self.known_hosts: dict[str, bool] = {}  # session host -> whether it is this peer's host

    def owns_session(self, session_id: str) -> bool:
        """Whether ``session_id`` (``host:port`` of a Transfer Engine) is on this peer's host: the same
        name, or a name resolving to one of the same addresses."""
        host = session_id.rpartition(":")[0].strip("[]")
        if not host:
            return False
        if host == self.host:
            return True
        known = self.known_hosts.get(host)
        if known is None:
            known = bool(_addresses(host) & _addresses(self.host))
            if len(self.known_hosts) < 64:
                self.known_hosts[host] = known
        return known


def _addresses(host: str) -> set[str]:
    try:
        return {i[4][0] for i in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


@dataclass
class _Read:
    key: ObjectKey
    peer: _Peer
    dest: "_Dest"
    token: object  # the destination's handle on the memory (staging offset, arena reservation)
    length: int
    handle: int
    state: int = READ_PENDING


class _Dest:
    """Where reads land and what a landed read becomes."""

    def alloc(self, n: int) -> tuple[int, object] | None:
        """(address, token) of ``n`` bytes to read into, or None when there is no room."""
        raise NotImplementedError

    def land(self, r: _Read) -> bool:
        """Verify a completed read and keep it; False when it does not verify. Always gives up ``r``'s
        memory or hands it over."""
        raise NotImplementedError

    def discard(self, r: _Read) -> None:
        """Give up the memory of a read that failed or finished after its fetch gave up on it."""
        raise NotImplementedError


def _check_segment(view: memoryview, key: ObjectKey) -> int | None:
    """Length of the valid segment of ``key`` at the start of ``view``, else None."""
    try:
        h, _ = parse_segment(view, exact=False)
    except SegmentError:
        return None
    if h.layer != key.layer or h.role != key.role:
        return None
    return h.nbytes


class _StagingDest(_Dest):
    """Reads land in the client's staging memory; verified segments are copied out as ``bytes``."""

    def __init__(self, staging: "_Staging") -> None:
        self.staging = staging
        self.out: dict[ObjectKey, bytes] = {}

    def alloc(self, n: int) -> tuple[int, object] | None:
        off = self.staging.alloc(n)
        return None if off is None else (self.staging.address + off, off)

    def land(self, r: _Read) -> bool:
        try:
            view = self.staging.view[r.token: r.token + r.length]
            n = _check_segment(view, r.key)
            if n is None:
                return False
            self.out[r.key] = bytes(view[:n])
            return True
        finally:
            self.discard(r)

    def discard(self, r: _Read) -> None:
        self.staging.free(r.token, r.length)


class _ArenaDest(_Dest):
    """Reads land in the Manager's own arena (registered with the same engine): ``reserve``d extents,
    ``publish``ed (which verifies them in place) or aborted. No copy and no fresh memory on the way."""

    def __init__(self, sink: "ArenaSink") -> None:
        self.sink = sink
        self.base = int(sink.arena_info().base_address)
        self.published: list[ObjectKey] = []

    def alloc(self, n: int) -> tuple[int, object] | None:
        try:
            res = self.sink.reserve(n)
        except OrbitKVError:  # pool full of leased objects, or a length the Manager refuses
            return None
        return self.base + res.offset, res

    def land(self, r: _Read) -> bool:
        # publish() is the verification (header, the key's layer and role, CRC32C, in place); checking
        # here as well would parse every header twice. It also says False when the key was published
        # meanwhile (a local save, another fetch): that is no fault of the peer, so look before blaming.
        if self.sink.publish(r.token, r.key):
            self.published.append(r.key)
            return True
        lease, (present,) = self.sink.lease_objects([r.key])
        if lease:
            self.sink.release(lease)
        return present is not None

    def discard(self, r: _Read) -> None:
        self.sink.abort(r.token)


class PeerClient:
    """Fetch segments from peer Managers over their control sockets and Transfer Engines.
    Thread-safe; several fetches may run at once."""

    def __init__(self, transport: Transport, config: PeerConfig | None = None, *,
                 secret: bytes | None = None) -> None:
        import zmq  # lazily: the core imports without pyzmq

        self._zmq = zmq
        self._secret = secret
        self._ctx = zmq.Context.instance()
        self.transport = transport
        self.config = config or PeerConfig()
        self._staging = _Staging(transport, self.config.staging_bytes)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(secrets.randbits(48) + 1)  # a restarted client's ids are not its last run's
        self._abandoned: list[_Read] = []  # parked reads (see _park)
        self._reaper: threading.Thread | None = None
        self._reaping = threading.Lock()  # serialises _reap
        self.counters = ClientCounters()
        self._closed = False

    # -- registry ----------------------------------------------------------------------------------

    def add_peer(self, address: str, *, static: bool = False) -> PeerInfo:
        """Register the peer Manager whose peer control socket is ``address`` (``host:port``)."""
        peer = _Peer(address, static)
        with self._lock:
            if address in self._peers:
                raise PeerError(f"peer {address} is already registered")
            self._peers[address] = peer
        return self._info(peer, time.monotonic())

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            raise UnknownPeer(peer_id)
        for s in peer.idle:
            s.close(0)
        peer.idle.clear()

    def peers(self) -> list[PeerInfo]:
        now = time.monotonic()
        with self._lock:
            return [self._info(p, now) for p in self._peers.values()]

    def get_peer(self, peer_id: str) -> PeerInfo:
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise UnknownPeer(peer_id)
            return self._info(peer, time.monotonic())

    @staticmethod
    def _info(p: _Peer, now: float) -> PeerInfo:
        remaining = max(0.0, p.backoff_until - now)
        return PeerInfo(id=p.address, address=p.address, session_id=p.session_id,
                        state="backoff" if remaining > 0 else "ok", consecutive_failures=p.consecutive,
                        backoff_remaining_s=round(remaining, 3), requests_total=p.requests,
                        keys_fetched_total=p.keys_fetched, fetched_bytes_total=p.fetched_bytes,
                        failures_total=dict(p.failures), static=p.static)

    def _eligible(self, now: float) -> list[_Peer]:
        with self._lock:
            ok = [p for p in self._peers.values() if p.backoff_until <= now]
        return ok[: self.config.fanout]

    def _fail(self, peer: _Peer, reason: str) -> None:
        with self._lock:
            peer.failures[reason] = peer.failures.get(reason, 0) + 1
            self.counters.failures[reason] += 1
            peer.consecutive += 1
            delay = min(self.config.backoff_base_s * 2 ** (peer.consecutive - 1), self.config.backoff_max_s)
            peer.backoff_until = time.monotonic() + delay
        log.info("peer %s failed (%s); backing off", peer.address, reason)

    def _succeed(self, peer: _Peer) -> None:
        with self._lock:
            peer.consecutive = 0
            peer.backoff_until = 0.0

    # -- sockets -------------------------------------------------------------------------------------

    def _socket(self, peer: _Peer):
        with self._lock:
            if peer.idle:
                return peer.idle.pop()
        zmq = self._zmq
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        s.connect(f"tcp://{peer.host}:{peer.port}")
        return s

    def _give_back(self, peer: _Peer, sock) -> None:
        with self._lock:
            if self._peers.get(peer.address) is peer and not self._closed:
                peer.idle.append(sock)
                return
        sock.close(0)

    def _exchange(self, asks: list[tuple[_Peer, P.Request]], deadline: float,
                  enough: Callable[[dict], bool] | None = None) -> dict[int, "P.Reply | str"]:
        """Send each request to its peer, collect replies until all came, ``enough(replies so far)`` or
        ``deadline``. Answers req_id -> reply, or a failure reason string for peers that broke the
        protocol or did not answer (an unanswered request is a timeout only when the deadline passed)."""
        zmq = self._zmq
        poller = zmq.Poller()
        want: dict[int, tuple[_Peer, object]] = {}
        socks: dict[object, _Peer] = {}
        for peer, req in asks:
            sock = next((s for s, p in socks.items() if p is peer), None) or self._socket(peer)
            socks[sock] = peer
            sock.send(P.seal(P.encode(req), self._secret, P.REQUEST), zmq.NOBLOCK)
            want[req.req_id] = (peer, sock)
            with self._lock:
                peer.requests += 1
        for s in socks:
            poller.register(s, zmq.POLLIN)
        out: dict[int, P.Reply | str] = {}
        broken: set = set()
        satisfied = False
        while len(out) < len(want) and not satisfied:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ in poller.poll(left * 1000):
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        rep = P.decode_reply(P.unseal(frame, self._secret, P.REPLY))
                    except P.ProtocolError:
                        broken.add(sock)
                        continue
                    entry = want.get(rep.req_id)
                    if entry is None or entry[1] is not sock:
                        continue  # the ack of an earlier release on this pooled socket
                    out[rep.req_id] = rep
            for sock in broken:
                for rid, (p, s) in want.items():
                    if s is sock and rid not in out:
                        out[rid] = FailureReason.PROTOCOL
            satisfied = enough is not None and enough(out)
        for sock, peer in socks.items():
            mine = [rid for rid, (p, s) in want.items() if s is sock]
            if sock not in broken and all(rid in out and not isinstance(out[rid], str) for rid in mine):
                self._give_back(peer, sock)
            else:  # an answer may still arrive on it later; never reuse it
                sock.close(0)
        if not satisfied:
            for rid in want:
                out.setdefault(rid, FailureReason.TIMEOUT)
        return out

    def _send_release(self, peer: _Peer, lease_id: int) -> None:
        sock = self._socket(peer)
        try:
            sock.send(P.seal(P.encode(P.ReleaseRequest(next(self._ids), lease_id)), self._secret, P.REQUEST),
                      self._zmq.NOBLOCK)
        except self._zmq.Again:  # peer gone and queue full: its TTL frees the lease
            sock.close(0)
            return
        self._give_back(peer, sock)

    # -- fetch ---------------------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ObjectKey]) -> Mapping[ObjectKey, bytes]:
        """Verified segment bytes (header + payload) of whichever ``keys`` a peer delivered in budget
        (read into staging memory, copied out)."""
        dest = _StagingDest(self._staging)
        self._fetch(keys, dest)
        return dest.out

    def fetch_into(self, sink: "ArenaSink", keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Read whichever ``keys`` peers deliver in budget straight into ``sink``'s arena (a Manager:
        ``reserve``, then ``publish``, which verifies in place). ``sink``'s arena must be registered with this
        client's engine (a :class:`~orbitkv_fs.peers.PeerNode` does that). Answers the keys published."""
        dest = _ArenaDest(sink)
        self._fetch(keys, dest)
        return dest.published

    def _fetch(self, keys: Sequence[ObjectKey], dest: _Dest) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.config.budget_s
        self._reap()
        keys = list(dict.fromkeys(keys))
        if not keys:
            return
        peers = self._eligible(t0)
        with self._lock:
            self.counters.keys_requested += len(keys)
        if not peers:
            with self._lock:
                self.counters.misses += len(keys)
            return
        by_ns: dict[bytes, list[ObjectKey]] = {}
        for k in keys:
            by_ns.setdefault(k.namespace, []).append(k)
        asks: list[tuple[_Peer, P.Request]] = []
        asked: dict[int, tuple[_Peer, bytes, list[ObjectKey]]] = {}
        for peer in peers:
            for ns, ks in by_ns.items():
                req = P.LeaseRequest(next(self._ids), ns, [k.pack() for k in ks], self.transport.session_id)
                asks.append((peer, req))
                asked[req.req_id] = (peer, ns, ks)
        wanted = set(keys)

        def all_found(got: dict[int, "P.Reply"]) -> bool:
            found: set[ObjectKey] = set()
            for rid, rep in got.items():
                if isinstance(rep, P.LeaseReply) and len(rep.extents) == len(asked[rid][2]):
                    found.update(k for k, e in zip(asked[rid][2], rep.extents) if e is not None)
            return found >= wanted

        # Leasing may use half the budget (a silent peer must not starve the reads of the ones that
        # answered), and stops early once every key has a holder.
        replies = self._exchange(asks, t0 + self.config.budget_s / 2, all_found)

        # Pick, per key, the first peer (in registry order) whose reply holds it. Failures are counted
        # (and backoffs start) when the fetch ends.
        leases: list[tuple[_Peer, int]] = []
        chosen: dict[ObjectKey, tuple[_Peer, P.LeaseReply, P.Extent]] = {}
        failed: dict[int, tuple[_Peer, str]] = {}
        for rid, rep in replies.items():
            peer, ns, ks = asked[rid]
            reason = self._check_reply(rep, ns, ks, peer)
            if reason is not None:
                failed.setdefault(id(peer), (peer, reason))
                continue
            assert isinstance(rep, P.LeaseReply)
            peer.session_id = rep.session_id
            if rep.lease_id:
                leases.append((peer, rep.lease_id))
            for k, ext in zip(ks, rep.extents):
                if ext is not None and k not in chosen:
                    chosen[k] = (peer, rep, ext)

        reads: list[_Read] = []
        unreachable: set[int] = set()
        staging_short = 0
        for k, (peer, rep, ext) in chosen.items():
            if id(peer) in unreachable:
                continue
            got = dest.alloc(ext.length)
            if got is None:
                staging_short += 1
                continue
            address, token = got
            r = _Read(k, peer, dest, token, ext.length, 0)
            try:
                r.handle = self.transport.submit_read(rep.session_id, address, rep.base_address + ext.offset,
                                                      ext.length)
            except TransportError:
                dest.discard(r)
                unreachable.add(id(peer))
                failed.setdefault(id(peer), (peer, FailureReason.UNREACHABLE))
                continue
            reads.append(r)
        if staging_short:
            with self._lock:
                self.counters.failures[FailureReason.STAGING] += staging_short

        fetched = [0, 0]  # segments, bytes

        def landed(r: _Read) -> None:
            # Runs as each read completes, while later ones are still on the wire: verification overlaps
            # the transfer instead of following it.
            if r.state != READ_DONE:
                dest.discard(r)
                failed.setdefault(id(r.peer), (r.peer, FailureReason.TRANSFER))
            elif not dest.land(r):
                failed.setdefault(id(r.peer), (r.peer, FailureReason.CHECKSUM))
            else:
                fetched[0] += 1
                fetched[1] += r.length
                with self._lock:
                    r.peer.keys_fetched += 1
                    r.peer.fetched_bytes += r.length

        self._wait(reads, deadline, landed)
        for peer, lease_id in leases:
            self._send_release(peer, lease_id)
        pending = [r for r in reads if r.state == READ_PENDING]
        for r in pending:
            failed.setdefault(id(r.peer), (r.peer, FailureReason.TIMEOUT))
        if pending:
            self._park(pending)
        for peer, reason in failed.values():
            self._fail(peer, reason)
        for rid in replies:
            peer = asked[rid][0]
            if id(peer) not in failed:
                self._succeed(peer)
        elapsed = time.monotonic() - t0
        with self._lock:
            c = self.counters
            c.lookups += 1
            c.keys_fetched += fetched[0]
            c.fetched_bytes += fetched[1]
            c.misses += len(keys) - fetched[0]
            c.fetch_seconds += elapsed
            if fetched[0]:
                c.hit_latency.observe(elapsed)

    def _check_reply(self, rep: "P.Reply | str", ns: bytes, ks: list[ObjectKey], peer: _Peer) -> str | None:
        if isinstance(rep, str):
            return rep
        if isinstance(rep, P.Refused):
            return FailureReason.NAMESPACE if rep.reason == P.RefuseReason.NAMESPACE else FailureReason.REFUSED
        if not isinstance(rep, P.LeaseReply):
            return FailureReason.PROTOCOL
        if rep.namespace != ns:
            return FailureReason.NAMESPACE
        if len(rep.extents) != len(ks) or not rep.session_id or rep.base_address <= 0:
            return FailureReason.PROTOCOL
        if not peer.owns_session(rep.session_id):
            log.warning("peer %s named Transfer Engine session %r on another host", peer.address, rep.session_id)
            return FailureReason.PROTOCOL
        for e in rep.extents:
            if e is not None and not (HEADER_SIZE <= e.length <= _MAX_EXTENT and e.offset >= 0):
                return FailureReason.PROTOCOL
        return None

    def _wait(self, reads: list[_Read], deadline: float, landed: Callable[[_Read], None]) -> None:
        """Poll ``reads`` until each is terminal (then ``landed(read)``) or ``deadline`` passes."""
        # The engine completes a peer's reads roughly in submission order: wait on the oldest one instead
        # of sweeping all of them (a sweep per pass costs O(n^2) status calls on large batches).
        spins = 0
        for i, r in enumerate(reads):
            while True:
                r.state = self.transport.poll(r.handle)
                if r.state != READ_PENDING:
                    landed(r)
                    break
                if time.monotonic() >= deadline:
                    for rest in reads[i + 1:]:
                        rest.state = self.transport.poll(rest.handle)
                        if rest.state != READ_PENDING:
                            landed(rest)
                    return
                spins += 1
                if spins & 63 == 0:
                    # Yield the GIL and the core now and then, but do not sleep: a sleeping poller wakes late
                    # on a busy host and loses the transfer's pace (the engine's own sync calls spin too).
                    time.sleep(0)

    def _park(self, reads: list[_Read]) -> None:
        """Keep ``reads`` (still pending when their fetch stopped waiting) until the engine ends them, with
        a reaper thread running while any is parked: their memory comes back without waiting for another
        fetch (a Manager whose peer died mid-read may fetch nothing for a long time)."""
        with self._lock:
            self._abandoned.extend(reads)
            if self._reaper is None and not self._closed:
                self._reaper = threading.Thread(target=self._reap_parked, name="orbitkv-peer-reaper", daemon=True)
                self._reaper.start()

    def _reap_parked(self) -> None:
        while True:
            time.sleep(_REAP_INTERVAL_S)
            self._reap()
            with self._lock:
                if not self._abandoned or self._closed:
                    self._reaper = None
                    return

    def _reap(self) -> None:
        """Free the parked reads the engine has ended (done or failed). One reap at a time (the reaper, a
        fetch, close), so that no read is freed twice; a read stays counted as parked until it is freed."""
        with self._reaping:
            with self._lock:
                parked = list(self._abandoned)
            ended = [r for r in parked if self.transport.poll(r.handle) != READ_PENDING]
            for r in ended:
                r.dest.discard(r)
            if ended:
                gone = {id(r) for r in ended}
                with self._lock:
                    self._abandoned = [r for r in self._abandoned if id(r) not in gone]

    # -- prefix lookups ------------------------------------------------------------------------------

    def lookup_prefix(self, namespace: bytes, chunks: Sequence[bytes], layers: Sequence[tuple[int, int]]) -> int:
        """The longest leading run of ``chunks`` one peer holds in full (0 without peers)."""
        peers = self._eligible(time.monotonic())
        if not peers or not chunks:
            return 0
        asks = [(p, P.PrefixRequest(next(self._ids), namespace, list(chunks),
                                    [(int(l), int(r)) for l, r in layers])) for p in peers]
        replies = self._exchange(asks, time.monotonic() + self.config.budget_s)
        best = 0
        for peer, req in asks:
            rep = replies[req.req_id]
            if isinstance(rep, P.PrefixReply) and rep.namespace == namespace and 0 <= rep.count <= len(chunks):
                best = max(best, rep.count)
                self._succeed(peer)
            elif isinstance(rep, str):
                self._fail(peer, rep)
            elif isinstance(rep, P.Refused):
                self._fail(peer, FailureReason.NAMESPACE if rep.reason == P.RefuseReason.NAMESPACE
                           else FailureReason.REFUSED)
            else:
                self._fail(peer, FailureReason.PROTOCOL)
        return best

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def staging(self) -> tuple[int, int]:
        """(size, bytes in use) of the staging memory."""
        return self._staging.size, self._staging.used

    @property
    def abandoned_reads(self) -> int:
        with self._lock:
            return len(self._abandoned)

    def close(self, timeout: float = 35.0) -> None:
        """Close sockets; wait (up to ``timeout``) for abandoned reads before unmapping staging memory.
        Reads still pending after that keep the mapping alive for the life of the process."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            reaper = self._reaper
        if reaper is not None:  # it stops after its current round: nothing may reap once staging is unmapped
            reaper.join()
        for p in peers:
            for s in p.idle:
                s.close(0)
            p.idle.clear()
        end = time.monotonic() + timeout
        while self.abandoned_reads and time.monotonic() < end:
            self._reap()
            time.sleep(0.01)
        if not self.abandoned_reads:
            self._staging.close(self.transport)
