"""The HTTP control plane's connections under abuse: how many may be open, and how long a request may take.

uvicorn bounds neither. It closes a connection for idleness only after a response (``timeout_keep_alive``),
so a connection that never finishes its first request -- or sends one byte of it a second -- is held for
good, and its ``limit_concurrency`` answers 503 only to a complete request, after the connection and its
descriptor are taken. A process with no credential could open connections until the Manager ran out of
descriptors: engines could no longer connect or register, ``/healthz`` stopped answering, and asyncio logged
every failed accept with a traceback (309 MB in a minute; docs/results/2026-12-05-http-flood).

Owns :class:`HttpLimits` (``--http-max-connections``, ``--http-request-timeout``), :class:`HttpConnectionStats`
(what the limits did, ``orbitkv_http_*`` metrics), :class:`ConnectionGuard` (one server's open connections)
and :func:`limited_protocol` (uvicorn's h11 protocol under a guard). The policy is the data plane's
(:mod:`orbitkv_fs.dataplane`):

* connections (``max_connections``): at the limit a new connection displaces the open connection that has
  gone longest without completing a request (or connected longest ago) among those not answering one. When
  every connection is answering a request, the new one is answered 503 ``busy`` and closed;
* a deadline per request (``request_timeout_s``): from a connection's start, or a request's first byte, to the
  request's last byte, however slowly its bytes keep coming; and for an answer the client does not take
  (the connection's send buffer full that long). The connection is reset. A request being answered is not
  limited (a flush may take a minute); between requests uvicorn's keep-alive timeout (5 s) closes idle
  connections;
* accept bursts (:attr:`HttpLimits.backlog`): asyncio accepts up to its listen backlog in one go before any
  protocol runs, so the backlog is a quarter of the limit -- a burst cannot displace a connection admitted in
  it before its request is read -- and the kernel's queue is deepened past it (:data:`LISTEN_QUEUE`).

Invariants: the guard and the protocol run on the server's event loop only; :meth:`ConnectionGuard.stats`
reads counts from any thread. A displaced or timed-out connection is aborted (reset), never left waiting on
a peer that does not read. Each kind of event is logged at most once per :data:`LOG_EVERY_S`, and so is
asyncio's own report of a failed accept (:class:`AcceptFailures`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
import msgspec

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
#: the kernel's queue of connections not yet accepted (uvicorn's default backlog)
LISTEN_QUEUE = 2048
_REQUEST_DONE = (h11.DONE, h11.MUST_CLOSE)
_BUSY_BODY = (b'{"code":"busy","message":"every connection of the control plane is answering a request; retry '
              b'(--http-max-connections)"}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
         b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


@dataclass(frozen=True)
class HttpLimits:
    """The control plane's bounds under abuse (see the module docstring)."""

    max_connections: int = 256
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not self.request_timeout_s > 0:
            raise ValueError("HTTP limits: max_connections >= 1, request_timeout_s > 0")

    @property
    def backlog(self) -> int:
        """How many connections asyncio accepts in one go before the protocol sees any of them (the backlog it
        listens with; :class:`~.app.HttpServer` then deepens the kernel's queue to :data:`LISTEN_QUEUE`). A
        quarter of the limit, so that one burst cannot displace a connection admitted in it before its
        request is read: with 512 a flood displaced 4% of other clients' requests unread."""
        return max(16, min(512, self.max_connections // 4))

    @property
    def descriptors(self) -> int:
        """Descriptors the control plane may hold at once under a flood: its connections, and the ones asyncio
        accepted ahead of admission (a backlog's worth per loop iteration, up to four in flight)."""
        return self.max_connections + 4 * self.backlog


class HttpConnectionStats(msgspec.Struct, frozen=True):
    """The control plane's connections and the times its limits bit."""

    connections: int
    max_connections: int
    request_timeout_s: float
    connections_displaced_total: int  # idle or unfinished connections closed to make room for a new one
    connections_refused_total: int  # answered 503 busy: every connection was answering a request
    request_timeouts_total: int  # requests not received, or answers not taken, within request_timeout_s


class ConnectionGuard:
    """One server's open connections and the counts of what its limits did."""

    def __init__(self, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
        self._open: set[Any] = set()
        self._displaced = self._refused = self._timeouts = 0
        self._logged: dict[str, float] = {}

    def admit(self, conn: Any) -> bool:
        """Take ``conn`` into the open set, displacing the longest-idle connection at the limit; False when
        every open connection is answering a request (the caller refuses ``conn``)."""
        if len(self._open) >= self.limits.max_connections:
            victim = min((c for c in self._open if not c.answering), key=lambda c: c.since, default=None)
            if victim is None:
                self._refused += 1
                self._note("refused", "every one of %d connections is answering a request: refusing more "
                           "(--http-max-connections)", self.limits.max_connections)
                return False
            self._open.discard(victim)
            self._displaced += 1
            self._note("displaced", "%d connections open: closing the longest idle to admit new ones "
                       "(--http-max-connections)", self.limits.max_connections)
            victim.abort()
        self._open.add(conn)
        return True

    def release(self, conn: Any) -> None:
        self._open.discard(conn)

    def timed_out(self) -> None:
        self._timeouts += 1
        self._note("timeout", "closed a connection whose request, or the taking of its answer, ran past %gs "
                   "(--http-request-timeout)", self.limits.request_timeout_s)

    def stats(self) -> HttpConnectionStats:
        return HttpConnectionStats(connections=len(self._open), max_connections=self.limits.max_connections,
                                   request_timeout_s=self.limits.request_timeout_s,
                                   connections_displaced_total=self._displaced,
                                   connections_refused_total=self._refused, request_timeouts_total=self._timeouts)

    def _note(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self._logged.get(kind, 0.0):
            self._logged[kind] = now + LOG_EVERY_S
            log.warning("http: " + msg, *args)


class AcceptFailures(logging.Filter):
    """asyncio logs a failed accept (out of descriptors) with its traceback once for every connection waiting
    in the backlog, schedules a retry for each, and logs each retry that fails: at most one such record per
    :data:`LOG_EVERY_S` passes, without the traceback, counting the ones dropped."""

    _KINDS = ("socket.accept() out of system resource", "Exception in callback BaseSelectorEventLoop._start_serving")

    def __init__(self) -> None:
        super().__init__()
        self._next = 0.0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith(self._KINDS):
            return True
        now = time.monotonic()
        if now < self._next:
            self.dropped += 1
            return False
        self._next = now + LOG_EVERY_S
        exc = record.exc_info[1] if record.exc_info else None
        record.msg = msg.splitlines()[0] + (f": {exc}" if exc is not None else "") + \
            (f" ({self.dropped} more such lines dropped)" if self.dropped else "")
        record.args, record.exc_info, record.exc_text = None, None, None
        self.dropped = 0
        return True


def limited_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class, its connections admitted and timed by ``guard`` (pass it as
    ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = guard.limits.request_timeout_s

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.since = 0.0  # when it connected or last completed a request: displacement's order
            # Two clocks, so that a client's next request cannot stop the one its unread answer runs on.
            self._request: asyncio.TimerHandle | None = None  # a request not yet received in full
            self._stall: asyncio.TimerHandle | None = None  # an answer the client is not taking

        @property
        def answering(self) -> bool:
            """A complete request whose answer is not yet out: never displaced."""
            return self.cycle is not None and not self.cycle.response_complete and \
                self.conn.their_state in _REQUEST_DONE

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not guard.admit(self):
                transport.write(_BUSY)
                transport.close()
                return
            self.since = self.loop.time()
            self._request = self._timer()

        def connection_lost(self, exc: Exception | None) -> None:
            guard.release(self)
            self._cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._request is None and self.conn.their_state is h11.IDLE:  # a new request begins
                self._request = self._timer()
            super().data_received(data)
            if self._request is not None and self.conn.their_state in _REQUEST_DONE:
                self._request.cancel()
                self._request = None
                self.since = self.loop.time()

        def pause_writing(self) -> None:  # the client is not taking the answer
            super().pause_writing()
            if self._stall is None:
                self._stall = self._timer()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def abort(self) -> None:
            self._cancel()
            self.transport.abort()  # even when closing: a close waits on a peer that may never read

        def _timer(self) -> asyncio.TimerHandle:
            return self.loop.call_later(timeout, self._expire)

        def _cancel(self) -> None:
            for t in (self._request, self._stall):
                if t is not None:
                    t.cancel()
            self._request = self._stall = None

        def _expire(self) -> None:
            guard.release(self)
            guard.timed_out()
            self.abort()

    return LimitedH11Protocol
