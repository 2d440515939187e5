"""The remote data plane: the client API over a local socket, ZeroMQ's wire protocol, msgpack via msgspec.

Owns the wire protocol between :class:`RemoteClient` (in the engine process) and :class:`DataPlaneServer`
(in ``orbitkv-cache-manager``). KV bytes never cross this socket: the Manager reads and writes the engine's
pages itself (shared-memory file or CUDA IPC); requests carry chunk keys and block ids only.

Transport: ZMTP 3.0 (ZeroMQ's wire protocol, RFC 23, NULL mechanism) over a Unix (``ipc://PATH``) or
loopback TCP (``tcp://HOST:PORT``) stream socket; the server is a ROUTER, the client a REQ. Both ends are
implemented here on plain sockets: libzmq moves every message through its I/O threads, four thread
wake-ups per round trip, which cost ~100 us on a small host -- more than a lookup itself. A libzmq REQ or
DEALER socket is still a valid client (the tests use one to send hostile bytes).

Message format: one request frame each way, after the REQ envelope (an empty delimiter frame). A request
is a msgspec-tagged struct (:data:`Request`); a reply is one status byte (0 ok, 1 error) then msgpack: the
call's result struct, or :class:`WireError` (error class name, message, field).

Server: one accepting thread and one thread per connection, which reads a request, runs it and writes the
reply; a REQ connection has one request in flight, so a connection's thread is its queue. Calls that may
wait on I/O or codecs (save, restore, register, unregister, invalidate, and lookups that consult a lower
tier or peers) take one of ``workers`` permits first; ping, stats, release and DRAM-only lookups do not,
so slow saves never delay lookups on other connections.

Access (docs/security.md): every engine call carries the credential its registration answered
(:attr:`~orbitkv_fs.manager.EngineInfo.credential`); the client remembers the credentials of the engines it
registered (:meth:`RemoteClient.set_credential` for engines registered over REST) and sends them itself.
A registration carries the connection's OS user (``SO_PEERCRED`` on ipc://, the socket owner of a loopback
TCP peer), so that only the registrant's own pages files are mapped. Invalidating anything but the calling
engine's own namespace needs the admin token (``admin_token`` of :class:`RemoteClient`).

Limits (:class:`DataPlaneLimits`, flags of ``orbitkv-cache-manager``), each counted when it bites
(:class:`DataPlaneStats`, ``orbitkv_dataplane_*`` metrics):

* bytes of messages being received or answered, all connections together (``max_buffered_bytes``); the
  first :data:`_FREE_BYTES` of each message do not count, so small requests are never refused. A message
  that does not fit is read and dropped, and answered :class:`DataPlaneBusy`;
* connections (``max_connections``): at the limit a new connection displaces the connection that has
  gone longest without starting a request among those that never acted for a registered engine (the
  engines' own connections are the reserved path: nothing anonymous displaces them; at most
  :data:`MAX_ENGINE_CONNECTIONS` per engine and a quarter of the limit per OS user count so). When every
  slot is an engine's or is answering a request, the new connection is refused with a ZMTP ``ERROR``
  command the client reads (:class:`DataPlaneBusy`), not a bare EOF;
* a deadline per message (``message_timeout_s``): a handshake, or a message from its first byte to its
  last, that takes longer is cut off, however slowly its bytes keep coming;
* what a request makes the server build: an engine call's chunks and keys are decoded only once its
  credential passed (:func:`_deferred`, :meth:`~orbitkv_fs.manager.Manager.authenticate`), and what they
  will build counts against ``max_buffered_bytes`` first (:meth:`DataPlaneServer._charge`); each list of a
  request holds at most :data:`MAX_ITEMS` items and a registration at most
  :data:`~orbitkv_fs.geometry.MAX_TENSORS` tensors, both checked from the list's header.

Invariants: malformed or hostile input gets a typed error reply, never a crash (bytes that are not ZMTP,
a message over :data:`MAX_MESSAGE` bytes or more than :data:`MAX_FRAMES` frames close that connection, as
libzmq does); a peer stalled inside a handshake, a message or a reply's send is dropped after
:data:`STALL_TIMEOUT_S` without progress, and close() waits for requests in flight at most a minute in all;
a failed accept (out of descriptors) never ends the accept thread; the server binds only loopback TCP or
ipc:// unless told otherwise; the client re-raises the same error classes the embedded Manager raises, so
both modes behave alike; a remote client is shareable between threads (one connection per thread, closed
when its thread ends) and times out instead of hanging when the server is gone.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import stat
import struct
import threading
import time
import urllib.parse
import weakref
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Sequence

import msgspec

from . import access as _access
from . import errors as _errors
from . import geometry as _geometry
from . import manager as _manager
from . import pages as _pages
from .access import AdminRequired, AdminToken, Caller, socket_uid
from .client import Client
from .errors import OrbitKVError
from .keys import PACKED_SIZE, ObjectKey
from .manager import (
    ChunkBlocks,
    EngineInfo,
    EngineRegistration,
    InvalidateResult,
    LookupResult,
    Manager,
    ManagerStats,
    RequestError,
    RestoreResult,
    SaveResult,
)

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:9092"
#: Bytes of one message. What an engine call's lists build counts against ``max_buffered_bytes`` too
#: (:data:`_BUILT_PER_BYTE`): at the default 256 MiB, up to about 19 MiB of chunks a call (290,000 chunks of 16
#: blocks).
MAX_MESSAGE = 64 << 20
MAX_FRAMES = 16  # frames of one message: a REQ sends 2, a DEALER client its own envelope
MAX_CONNECTIONS = 1024
#: Connections one engine's credential marks as the engine's own (never displaced); more are served as
#: anonymous ones: an engine cannot take every slot. Nor can one OS user with many engines: its engines'
#: connections count so up to a quarter of the connection limit (or this many, whichever is more).
MAX_ENGINE_CONNECTIONS = 64
# Longest wait without progress in a handshake, a message once its first byte came, or a reply's send
# (libzmq's ZMQ_HANDSHAKE_IVL default). Waiting between messages is not limited -- an engine thread's
# connection idles between calls -- and the message deadline (DataPlaneLimits) bounds a message in all.
STALL_TIMEOUT_S = 30.0
#: Bytes of each message that need no share of ``max_buffered_bytes`` (lookups, releases, small saves).
_FREE_BYTES = 64 << 10
#: Items of one list in a request (chunks, keys, layers), checked from the list's header before any item is
#: built: 2^20 chunks are a 16M-token prompt at one 16-token block a chunk, more than any engine sends at once.
MAX_ITEMS = 1 << 20
#: Bytes of Python objects a request's chunks or keys may build from one byte of msgpack, the most measured
#: (docs/results/2026-12-05-dataplane-bulk): a block id 257..65535 is 3 bytes on the wire, an int and a list
#: slot (36 bytes) once built. An engine call's decoded lists count against ``max_buffered_bytes`` at this
#: rate, past the first :data:`_FREE_BYTES` of the message.
_BUILT_PER_BYTE = 13
_KEEPALIVE_IDLE_S = 60
_CLOSE_WAIT_S = 60.0  # close(): longest wait, all connections together, for the requests in flight
_RECONNECT_S = 0.1  # libzmq's default reconnect interval (ZMQ_RECONNECT_IVL)
_LEASES_REMEMBERED = 1 << 16  # lease id -> engine, per remote client (a release names the lease's engine)


@dataclass(frozen=True)
class DataPlaneLimits:
    """The data plane's bounds under abuse (see the module docstring)."""

    max_connections: int = MAX_CONNECTIONS
    max_buffered_bytes: int = 256 << 20
    message_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_buffered_bytes < 0 or not self.message_timeout_s > 0:
            raise ValueError("data plane limits: max_connections >= 1, max_buffered_bytes >= 0, "
                             "message_timeout_s > 0")


class DataPlaneStats(msgspec.Struct, frozen=True):
    """The data plane's connections, buffers and the times its limits bit."""

    connections: int
    engine_connections: int  # connections that acted for a registered engine (never displaced)
    buffered_bytes: int  # message bytes held against max_buffered_bytes now
    max_connections: int
    max_buffered_bytes: int
    message_timeout_s: float
    connections_refused_total: int  # refused with a ZMTP ERROR: every slot an engine's or busy
    connections_displaced_total: int  # anonymous connections closed to make room for a new one
    message_timeouts_total: int  # handshakes or messages cut off at the message deadline
    buffer_refusals_total: int  # messages dropped and answered DataPlaneBusy (max_buffered_bytes)
    auth_failures_total: int  # calls refused: no or a wrong credential, an admin act without the token


class DataPlaneBusy(OrbitKVError):
    """The data plane refused a connection (every slot taken) or a message (the buffer bound): retry later."""


class Register(msgspec.Struct, tag="register", array_like=True):
    reg: EngineRegistration


class Unregister(msgspec.Struct, tag="unregister", array_like=True):
    engine_id: str
    credential: str = ""


_Items = msgspec.Meta(max_length=MAX_ITEMS)


_ChunkKey = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Lookup(msgspec.Struct, tag="lookup", array_like=True):
    engine_id: str
    chunks: Annotated[list[_ChunkKey], _Items]
    lease: bool = True
    credential: str = ""


class Save(msgspec.Struct, tag="save", array_like=True):
    engine_id: str
    chunks: Annotated[list[ChunkBlocks], _Items]
    credential: str = ""


class Restore(msgspec.Struct, tag="restore", array_like=True):
    engine_id: str
    chunks: Annotated[list[ChunkBlocks], _Items]
    lease_id: int = 0
    layers: Annotated[list[int], _Items] | None = None
    credential: str = ""


class Release(msgspec.Struct, tag="release", array_like=True):
    lease_id: int
    engine_id: str = ""  # the engine whose lookup handed the lease out
    credential: str = ""


class Invalidate(msgspec.Struct, tag="invalidate", array_like=True):
    keys: Annotated[list[bytes], _Items] | None = None  # packed ObjectKeys
    chunks: Annotated[list[_ChunkKey], _Items] | None = None
    namespace: bytes | None = None
    engine_id: str | None = None
    all: bool = False
    credential: str = ""  # of engine_id: an engine invalidating its own namespace
    admin_token: str = ""  # anything wider


class Stats(msgspec.Struct, tag="stats", array_like=True):
    pass


class Ping(msgspec.Struct, tag="ping", array_like=True):
    pass


Request = Register | Unregister | Lookup | Save | Restore | Release | Invalidate | Stats | Ping


class WireError(msgspec.Struct, array_like=True):
    type: str
    message: str
    field: str | None = None


_OK, _ERR = b"\x00", b"\x01"
_ENC = msgspec.msgpack.Encoder()
_NIL = msgspec.Raw(b"\xc0")


def _deferred(cls: type, bulk: tuple[str, ...]) -> type:
    """``cls`` as the server first reads it: its ``bulk`` fields (a request's chunks, keys) kept as raw msgpack,
    skipped over without building anything. They are decoded (:func:`_bulk`, as ``cls`` types them) once the
    call's credential passed, so a process without one makes the Manager build nothing per item."""
    fields: list[tuple] = []
    for f in msgspec.structs.fields(cls):
        if f.name in bulk:
            fields.append((f.name, msgspec.Raw) if f.required else (f.name, msgspec.Raw, _NIL))
        else:
            fields.append((f.name, f.type) if f.required else (f.name, f.type, f.default))
    return msgspec.defstruct(f"Deferred{cls.__name__}", fields, tag=cls.__struct_config__.tag, array_like=True,
                             module=__name__)


_LOOKUP, _SAVE, _RESTORE = (_deferred(c, ("chunks",)) for c in (Lookup, Save, Restore))
_INVALIDATE = _deferred(Invalidate, ("keys", "chunks"))
_REQ_DEC = msgspec.msgpack.Decoder(Register | Unregister | _LOOKUP | _SAVE | _RESTORE | Release |  # type: ignore
                                   _INVALIDATE | Stats | Ping)
_BULK_DEC = {(c, f.name): msgspec.msgpack.Decoder(f.type) for c in (Lookup, Save, Restore, Invalidate)
             for f in msgspec.structs.fields(c) if f.name in ("chunks", "keys")}


def _bulk(raw: msgspec.Raw, cls: type, field: str) -> Any:
    """The ``field`` of a ``cls`` request from its raw msgpack (:func:`_deferred`). Raises :class:`RequestError`."""
    try:
        return _BULK_DEC[cls, field].decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise RequestError(f"malformed request: {field}: {e}") from None


class ProtocolError(OrbitKVError):
    """The peer broke ZMTP framing: the connection is closed (there is no frame to answer in)."""


def _error_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {"DataPlaneBusy": DataPlaneBusy, "ProtocolError": ProtocolError}
    for mod in (_errors, _geometry, _manager, _pages, _access):
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, OrbitKVError):
                out[name] = obj
    return out


_ERRORS = _error_classes()
_LIGHT = (Ping, Stats, Release)  # never wait on I/O or codecs: no worker permit


# -- ZMTP 3.0, NULL mechanism ------------------------------------------------------------------------------

_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
assert len(_GREETING) == 64
_MORE, _LONG, _COMMAND = 1, 2, 4
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_DELIMITER = b"\x01\x00"  # REQ envelope: an empty frame with MORE set
_ROUTER_PEERS = (b"REQ", b"DEALER", b"ROUTER")  # socket types a ROUTER talks to (RFC 28)


def _frame(body: bytes, flags: int = 0) -> bytes:
    n = len(body)
    if n < 256:
        return bytes((flags, n)) + body
    return bytes((flags | _LONG,)) + _U64.pack(n) + body


def _ready(socket_type: bytes) -> bytes:
    props = b"\x0bSocket-Type" + _U32.pack(len(socket_type)) + socket_type
    return _frame(b"\x05READY" + props, _COMMAND)


def _read_exact(rfile: Any, n: int) -> bytes:
    b = rfile.read(n)
    if len(b) != n:
        raise EOFError
    return b


#: Bytes a READY command may take: its properties (socket type, identity of at most 255 bytes, ...).
_MAX_READY = 4096


def _frame_header(rfile: Any, room: int) -> tuple[int, int]:
    """``(flags, body length)`` of the next frame, whose body may take at most ``room`` bytes. EOFError at a
    clean end of stream."""
    hdr = rfile.read(2)
    if len(hdr) != 2:
        raise EOFError
    flags = hdr[0]
    if flags & ~(_MORE | _LONG | _COMMAND) or flags & _COMMAND and flags & _MORE:
        raise ProtocolError(f"bad frame flags {flags:#04x}")
    n = _U64.unpack(hdr[1:] + _read_exact(rfile, 7))[0] if flags & _LONG else hdr[1]
    if n > room:
        raise ProtocolError(f"a message over the {MAX_MESSAGE}-byte limit")
    return flags, n


def _read_frame(rfile: Any, room: int = MAX_MESSAGE) -> tuple[int, bytes]:
    """One frame of at most ``room`` bytes: ``(flags, body)``. EOFError at a clean end of stream."""
    flags, n = _frame_header(rfile, room)
    return flags, _read_exact(rfile, n)


def _skip(rfile: Any, n: int) -> None:
    """Read and drop ``n`` bytes (a refused message), holding at most 64 KiB of them at a time."""
    while n > 0:
        got = len(rfile.read(min(n, 1 << 16)))
        if not got:
            raise EOFError
        n -= got


class _Overloaded(Exception):
    """A message read and dropped for the buffer bound; ``envelope`` are its frames before the body (None
    when the dropped frame was not the last: then there is nothing to answer in)."""

    def __init__(self, envelope: list[bytes] | None) -> None:
        self.envelope = envelope


def _read_message(rfile: Any, take: Callable[[int], bool] | None = None) -> list[bytes]:
    """The frames of one message (commands after the handshake, e.g. 3.1 heartbeats, are skipped). With
    ``take``, bytes of the message past its first :data:`_FREE_BYTES` are asked of ``take(n)`` before they
    are read; a refusal drops the rest of the message and raises :class:`_Overloaded`."""
    frames: list[bytes] = []
    room = MAX_MESSAGE
    free = _FREE_BYTES
    while True:
        flags, n = _frame_header(rfile, room)
        if flags & _COMMAND:
            if frames:
                raise ProtocolError("command inside a message")
            if n > _MAX_READY:  # PING/PONG carry a few bytes; nothing after the handshake needs more
                raise ProtocolError(f"a command of {n} bytes")
            _read_exact(rfile, n)
            continue
        need = n - free
        free = max(free - n, 0)
        if need > 0 and take is not None and not take(need):
            _skip(rfile, n)
            last = not flags & _MORE
            while flags & _MORE:  # the rest of the message goes the same way
                room -= n
                flags, n = _frame_header(rfile, room)
                if flags & _COMMAND:
                    raise ProtocolError("command inside a message")
                _skip(rfile, n)
            raise _Overloaded(frames if last else None)
        frames.append(_read_exact(rfile, n))
        room -= n
        if not flags & _MORE:
            return frames
        if len(frames) >= MAX_FRAMES:
            raise ProtocolError(f"more than {MAX_FRAMES} frames in one message")


def _handshake(sock: socket.socket, rfile: Any, own_type: bytes, peer_types: tuple[bytes, ...]) -> None:
    """Exchange greetings and READY commands; raises ProtocolError unless the peer is a NULL-mechanism
    ZMTP 3.x socket of one of ``peer_types``."""
    try:
        sock.sendall(_GREETING + _ready(own_type))
    except (BrokenPipeError, ConnectionResetError):
        if own_type == b"ROUTER":
            raise
        # A server that refused this connection may have closed it already: its ERROR is still to read.
    g = _read_exact(rfile, 64)
    if g[0] != 0xFF or not g[9] & 1:
        raise ProtocolError("not a ZMTP peer")
    if g[10] < 3:
        raise ProtocolError(f"ZMTP {g[10]}.x peer; 3.0 or later needed")
    if g[12:32].rstrip(b"\x00") != b"NULL":
        raise ProtocolError(f"security mechanism {g[12:32].rstrip(bytes(1))!r}; only NULL is served")
    flags, body = _read_frame(rfile, _MAX_READY)  # a peer not yet greeted gets no 64 MiB buffer
    if flags & _COMMAND and body[:6] == b"\x05ERROR" and own_type != b"ROUTER":
        reason = body[7:7 + body[6]].decode(errors="replace") if len(body) > 6 else ""
        raise DataPlaneBusy(f"the data plane refused the connection: {reason}")
    if not flags & _COMMAND or body[:6] != b"\x05READY":
        raise ProtocolError("expected a READY command")
    props: dict[bytes, bytes] = {}
    i = 6
    while i < len(body):
        nlen = body[i]
        name = body[i + 1:i + 1 + nlen].lower()
        if i + 5 + nlen > len(body):
            raise ProtocolError("truncated READY property")
        vlen = _U32.unpack_from(body, i + 1 + nlen)[0]
        i += 5 + nlen
        if i + vlen > len(body):
            raise ProtocolError("truncated READY property")
        props[name] = body[i:i + vlen]
        i += vlen
    peer = props.get(b"socket-type", b"")
    if peer not in peer_types:
        raise ProtocolError(f"peer socket type {peer!r}; expected one of {peer_types}")


def _parse_endpoint(endpoint: str) -> tuple[int, Any]:
    """``(address family, address)`` of ``ipc://PATH`` or ``tcp://HOST:PORT``."""
    u = urllib.parse.urlparse(endpoint)
    if u.scheme == "ipc":
        path = endpoint[len("ipc://"):]
        if not path:
            raise ValueError(f"data plane endpoint {endpoint!r}: no path")
        return socket.AF_UNIX, path
    if u.scheme != "tcp":
        raise ValueError(f"data plane endpoint {endpoint!r}: expected ipc:// or tcp://")
    try:
        port = u.port
    except ValueError:
        port = None
    if not u.hostname or port is None:
        raise ValueError(f"data plane endpoint {endpoint!r}: expected tcp://HOST:PORT")
    host = "0.0.0.0" if u.hostname == "*" else u.hostname  # ZeroMQ's spelling of every interface
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, port)


def _check_endpoint(endpoint: str, allow_remote: bool) -> None:
    fam, addr = _parse_endpoint(endpoint)
    if fam == socket.AF_UNIX:
        return
    if not allow_remote and addr[0] not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"data plane endpoint {endpoint!r} is not loopback; the data plane has no "
                         "authentication (pass allow_remote to bind it anyway)")


def _endpoint_of(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"ipc://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"tcp://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"tcp://{host}:{port}"


def _bind(endpoint: str) -> socket.socket:
    fam, addr = _parse_endpoint(endpoint)
    if fam == socket.AF_UNIX:
        try:
            if stat.S_ISSOCK(os.stat(addr).st_mode):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(addr)
                except ConnectionRefusedError:
                    os.unlink(addr)  # left behind by a process that is gone
                else:
                    raise OrbitKVError(f"cannot bind the data plane to {endpoint}: another process serves it")
                finally:
                    probe.close()
        except FileNotFoundError:
            pass
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        if fam != socket.AF_UNIX:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(128)
    except OSError as e:
        s.close()
        raise OrbitKVError(f"cannot bind the data plane to {endpoint}: {e}") from None
    return s


def _keepalive(sock: socket.socket) -> None:
    """TCP keep-alive: a remote client host that vanished (allow_remote) leaves a half-open connection that
    never reads EOF; probes end it in about two minutes instead of holding a thread and a slot forever. Idle
    connections between live ends are not limited (engine threads idle between calls)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, opt):  # Linux names; elsewhere the OS defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class _Link:
    """The server's side of one connection."""

    __slots__ = ("sock", "caller", "engine", "user", "since", "started", "busy", "held", "take")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.caller = Caller(uid_of=lambda: socket_uid(sock))
        self.engine: str | None = None  # the engine it acted for: never displaced
        self.user: int | None = None  # that connection's OS user, once it is an engine's
        self.since = now  # accepted, or its last request began: the displacement order
        self.started = now  # when the handshake or the message being read began; 0.0 between messages
        self.busy = False  # a request decoded and being answered
        self.held = 0  # bytes of the current message counted in the buffer bound
        self.take: Callable[[int], bool] = lambda n: False


def _refuse(sock: socket.socket, reason: str) -> None:
    """Tell a connection the server will not serve it (a ZMTP ERROR command after the greeting), then
    close it. Never blocks: it all fits in the socket's buffer."""
    why = reason.encode()[:255]
    try:
        sock.setblocking(False)
        sock.send(_GREETING + _frame(b"\x05ERROR" + bytes((len(why),)) + why, _COMMAND))
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):  # what the peer sent already: closing over unread bytes would reset
            pass
    except OSError:
        pass
    finally:
        sock.close()


class DataPlaneServer:
    """Serves a :class:`Manager` on ``endpoint`` until :meth:`close` (see the module docstring).
    ``admin_token`` allows admin acts (invalidating beyond an engine's namespace) on the data plane;
    without one there are none here (the HTTP control plane has them)."""

    def __init__(self, manager: Manager, endpoint: str = DEFAULT_ENDPOINT, *, workers: int = 4,
                 allow_remote: bool = False, limits: DataPlaneLimits | None = None,
                 admin_token: AdminToken | None = None) -> None:
        _check_endpoint(endpoint, allow_remote)
        self.manager = manager
        self.limits = limits or DataPlaneLimits()
        self._admin = admin_token
        self._listener = _bind(endpoint)
        self.endpoint = _endpoint_of(self._listener)
        self._permits = threading.BoundedSemaphore(max(1, workers))
        self._conns: dict[socket.socket, _Link] = {}
        self._threads: dict[socket.socket, threading.Thread] = {}
        self._engine_links: collections.Counter[str] = collections.Counter()
        self._user_links: collections.Counter[int | None] = collections.Counter()
        self._lock = threading.Lock()
        self._buffered = 0
        self._counts = collections.Counter()  # the *_total fields of DataPlaneStats
        self._stop = False
        self._stopped = threading.Event()
        self._full_logged = float("-inf")  # when the last "connection limit reached" line was logged
        self._thread = threading.Thread(target=self._accept, name="dataplane-accept", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(target=self._watchdog, name="dataplane-deadlines", daemon=True)
        self._watch.start()

    # -- connections -----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._stop:  # close() shut the listener down
                    return
                # Out of descriptors (EMFILE, ENFILE) or a peer gone before accept: transient, and the
                # accept thread must outlive it or the server stops taking connections for good.
                log.warning("data plane: accept failed: %s", e)
                time.sleep(_RECONNECT_S)
                continue
            now = time.monotonic()
            victim = None
            with self._lock:
                if self._stop:
                    sock.close()
                    continue
                full = len(self._conns) >= self.limits.max_connections
                if full:
                    victim = self._displaceable()
                    if victim is not None:
                        self._drop(victim)
                        self._counts["displaced"] += 1
                    else:
                        self._counts["refused"] += 1
                        log_it = now >= self._full_logged + 10
                        if log_it:
                            self._full_logged = now  # at most one line per 10 s of refusals
                if not full or victim is not None:
                    link = _Link(sock, now)
                    link.take = lambda n, link=link: self._take(link, n)
                    t = threading.Thread(target=self._serve, args=(link,), name="dataplane-conn", daemon=True)
                    self._conns[sock] = link
                    self._threads[sock] = t
            if victim is not None:
                _shut(victim.sock)
            if full and victim is None:
                _refuse(sock, f"{self.limits.max_connections} connections open, each an engine's or busy")
                if log_it:
                    log.warning("data plane: %d connections open, each an engine's or answering a request: "
                                "refusing more (--data-plane-max-connections)", self.limits.max_connections)
                continue
            t.start()

    def _displaceable(self) -> _Link | None:
        """The anonymous connection that began its last request (or connected) longest ago, not answering
        one now. Called with ``_lock`` held."""
        best = None
        for link in self._conns.values():
            if link.engine is None and not link.busy and (best is None or link.since < best.since):
                best = link
        return best

    def _drop(self, link: _Link) -> None:
        """Forget ``link`` (its thread ends on its own). Called with ``_lock`` held."""
        if self._conns.pop(link.sock, None) is None:
            return
        self._threads.pop(link.sock, None)
        if link.engine is not None:
            for table, key in ((self._engine_links, link.engine), (self._user_links, link.user)):
                table[key] -= 1
                if table[key] <= 0:
                    del table[key]
        if link.held:
            self._buffered -= link.held
            link.held = 0

    def _mark(self, link: _Link, engine_id: str) -> None:
        """``link`` acted for ``engine_id``: from now on it is that engine's (within its quotas)."""
        user = link.caller.uid()
        with self._lock:
            if link.engine is None and link.sock in self._conns and \
                    self._engine_links[engine_id] < MAX_ENGINE_CONNECTIONS and \
                    self._user_links[user] < max(self.limits.max_connections // 4, MAX_ENGINE_CONNECTIONS):
                link.engine, link.user = engine_id, user
                self._engine_links[engine_id] += 1
                self._user_links[user] += 1

    def _take(self, link: _Link, n: int) -> bool:
        with self._lock:
            if link.sock not in self._conns:  # displaced meanwhile: its thread is about to end
                return False
            if self._buffered + n > self.limits.max_buffered_bytes:
                self._counts["buffer"] += 1
                return False
            self._buffered += n
            link.held += n
            return True

    def _give(self, link: _Link) -> None:
        with self._lock:
            if link.held and link.sock in self._conns:
                self._buffered -= link.held
            link.held = 0

    def _watchdog(self) -> None:
        """Cut off handshakes and messages past the message deadline, however slowly their bytes come."""
        timeout = self.limits.message_timeout_s
        while not self._stopped.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                late = [link for link in self._conns.values()
                        if link.started and not link.busy and now - link.started > timeout]
                for link in late:
                    link.started = 0.0
                self._counts["deadline"] += len(late)
            for link in late:
                _shut(link.sock)
            if late:
                log.warning("data plane: cut off %d connection(s) whose handshake or message took over %gs "
                            "(--data-plane-message-timeout)", len(late), timeout)

    def _serve(self, link: _Link) -> None:
        """One connection: handshake, then request -> reply until the peer or :meth:`close` ends it."""
        sock = link.sock
        rfile = sock.makefile("rb", 1 << 16)  # holds the descriptor open until it is closed too
        try:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keepalive(sock)
            sock.settimeout(STALL_TIMEOUT_S)
            _handshake(sock, rfile, b"ROUTER", _ROUTER_PEERS)
            while True:
                link.started = 0.0
                sock.settimeout(None)  # idle between requests: no limit
                if not rfile.peek(1):
                    break
                link.started = link.since = time.monotonic()
                sock.settimeout(STALL_TIMEOUT_S)  # a message begun must arrive, and its reply go out
                try:
                    frames = _read_message(rfile, link.take)
                except _Overloaded as e:
                    self._give(link)
                    if e.envelope is None:
                        raise ProtocolError("an envelope frame over the buffer bound") from None
                    reply = _ERR + _ENC.encode(WireError("DataPlaneBusy", self._busy()))
                    frames = e.envelope + [b""]
                else:
                    link.busy = True
                    reply = self._answer(frames[-1], link)
                # The envelope goes back as it came (REQ: one empty delimiter), MORE on all but the last.
                sock.sendall(b"".join(_frame(f, _MORE) for f in frames[:-1]) + _frame(reply))
                link.busy = False
                if link.held:
                    self._give(link)
        except EOFError:
            pass
        except ProtocolError as e:
            log.warning("data plane: dropping a connection: %s", e)
        except OSError:
            pass  # the peer went away, stalled or ran past its deadline, was displaced, or close() shut it
        finally:
            with self._lock:
                self._drop(link)
            rfile.close()
            sock.close()

    # -- requests --------------------------------------------------------------------------------------

    def _answer(self, msg: bytes, link: _Link) -> bytes:
        try:
            req = _REQ_DEC.decode(msg)
        except (msgspec.DecodeError, RecursionError) as e:  # ValidationError is a DecodeError
            return _ERR + _ENC.encode(WireError("RequestError", f"malformed request: {e}"))
        m = self.manager
        if type(req) in _LIGHT or (type(req) is _LOOKUP and m.lower is None and m.peers is None):
            return self._reply(req, link)
        with self._permits:
            return self._reply(req, link)

    def _reply(self, req: Any, link: _Link) -> bytes:
        """One decoded request's reply bytes. Never raises."""
        try:
            out = self._dispatch(req, link)
        except _access.AccessDenied as e:
            with self._lock:
                self._counts["auth"] += 1
            return _ERR + _ENC.encode(WireError(type(e).__name__, str(e), getattr(e, "field", None)))
        except OrbitKVError as e:
            return _ERR + _ENC.encode(WireError(type(e).__name__, _message(e), getattr(e, "field", None)))
        except (ValueError, TypeError) as e:  # bad values that passed the schema (e.g. a 3-byte namespace)
            return _ERR + _ENC.encode(WireError("RequestError", str(e)))
        except Exception as e:  # a bug: report it, keep serving
            log.exception("data plane request %s failed", type(req).__name__)
            return _ERR + _ENC.encode(WireError("OrbitKVError", f"internal error: {type(e).__name__}: {e}"))
        if link.engine is None and type(req) is not Unregister:
            engine_id = out.engine_id if type(req) is Register else getattr(req, "engine_id", None)
            if engine_id:
                self._mark(link, engine_id)
        return _OK + _ENC.encode(out)

    def _dispatch(self, req: Any, link: _Link) -> Any:
        m = self.manager
        caller = link.caller
        caller.credential = getattr(req, "credential", "")
        # Each engine call is authenticated before its chunks or keys are decoded (_deferred), and again by
        # the call itself.
        if type(req) is _LOOKUP:
            chunks = self._chunks(req, Lookup, link, caller, lookup=not req.lease)
            return m.lookup(req.engine_id, chunks, lease=req.lease, caller=caller)
        if type(req) is _SAVE:
            return m.save(req.engine_id, self._chunks(req, Save, link, caller), caller=caller)
        if type(req) is _RESTORE:
            return m.restore(req.engine_id, self._chunks(req, Restore, link, caller), lease_id=req.lease_id,
                             layers=req.layers, caller=caller)
        if isinstance(req, Release):
            m.release(req.lease_id, engine_id=req.engine_id, caller=caller)
            return None
        if isinstance(req, Register):
            return m.register_engine(req.reg, caller=caller)
        if isinstance(req, Unregister):
            m.unregister_engine(req.engine_id, caller=caller)
            return None
        if type(req) is _INVALIDATE:
            who = self._invalidator(req, caller)
            if who is None or req.engine_id is not None:  # the operator, or an engine that proves it is one
                if who is not None:
                    m.authenticate(req.engine_id, who)
                self._charge(link, req.keys, req.chunks)
                packed, chunks = _bulk(req.keys, Invalidate, "keys"), _bulk(req.chunks, Invalidate, "chunks")
            else:  # neither: the Manager refuses it by which selectors it names, never reading their lists
                packed = None if req.keys == _NIL else []
                chunks = None if req.chunks == _NIL else []
            keys = None if packed is None else _unpack_keys(packed)
            return m.invalidate(keys=keys, chunks=chunks, namespace=req.namespace, engine_id=req.engine_id,
                                all=req.all, caller=who)
        if isinstance(req, Stats):
            return m.stats()
        return None  # Ping

    def _chunks(self, req: Any, cls: type, link: _Link, caller: Caller, *, lookup: bool = False) -> Any:
        """The chunks of an engine call ``req`` (deferred ``cls``), once the caller proved it may act for the
        engine and what they will build was counted against the buffer bound."""
        self.manager.authenticate(req.engine_id, caller, lookup=lookup)
        self._charge(link, req.chunks)
        return _bulk(req.chunks, cls, "chunks")

    def _charge(self, link: _Link, *bulk: msgspec.Raw) -> None:
        """Count what an authenticated call's lists will build against the buffer bound, before they are
        built (:data:`_BUILT_PER_BYTE` a byte past the message's free part; given back with the message's
        bytes once the call is answered). Raises :class:`RequestError` for lists that could never fit,
        :class:`DataPlaneBusy` for lists that do not fit now."""
        n = _BUILT_PER_BYTE * (sum(len(b) for b in bulk) - _FREE_BYTES)
        if n <= 0:
            return
        if n > self.limits.max_buffered_bytes:
            raise RequestError(f"this request's lists would build about {n} bytes, over the data plane's bound "
                               f"({self.limits.max_buffered_bytes}, --data-plane-max-buffered): send fewer chunks "
                               "a call")
        if not self._take(link, n):
            raise DataPlaneBusy(self._busy())

    def _busy(self) -> str:
        return (f"the data plane holds {self._buffered} bytes of requests (bound {self.limits.max_buffered_bytes}, "
                "--data-plane-max-buffered): retry")

    def _invalidator(self, req: Any, caller: Caller) -> Caller | None:
        """None (the operator: anything goes) for a call with the admin token, else the engine ``caller``
        (its own namespace only)."""
        if not req.admin_token:
            return caller
        if self._admin is None:
            raise AdminRequired("this Manager has no admin token: admin acts go through the HTTP control plane")
        if not self._admin.matches(req.admin_token):
            raise AdminRequired("the admin token is not this Manager's")
        return None

    def stats(self) -> DataPlaneStats:
        with self._lock:
            c = self._counts
            return DataPlaneStats(
                connections=len(self._conns), engine_connections=sum(self._engine_links.values()),
                buffered_bytes=self._buffered, max_connections=self.limits.max_connections,
                max_buffered_bytes=self.limits.max_buffered_bytes, message_timeout_s=self.limits.message_timeout_s,
                connections_refused_total=c["refused"], connections_displaced_total=c["displaced"],
                message_timeouts_total=c["deadline"], buffer_refusals_total=c["buffer"],
                auth_failures_total=c["auth"])

    def close(self) -> None:
        """Stop serving: no new connections or requests; requests in flight finish and are answered."""
        with self._lock:
            self._stop = True
            conns = list(self._threads.items())
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=10)
        self._watch.join(timeout=10)
        self._listener.close()
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RD)  # the thread's next read ends; a reply in progress still goes
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for _, t in conns:
            t.join(timeout=max(deadline - time.monotonic(), 0))


def _shut(sock: socket.socket) -> None:
    """End a connection another thread serves: its blocked read returns and the thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _unpack_keys(packed: list[bytes]) -> list[ObjectKey]:
    out = []
    for i, k in enumerate(packed):
        if len(k) != PACKED_SIZE:
            raise RequestError(f"keys[{i}]: a packed object key is {PACKED_SIZE} bytes, not {len(k)}")
        try:
            out.append(ObjectKey.unpack(k))
        except ValueError as e:
            raise RequestError(f"keys[{i}]: {e}") from None
    return out


def _message(e: BaseException) -> str:
    return str(e.args[0]) if len(e.args) == 1 and isinstance(e, KeyError) else str(e)


def _raise(err: WireError) -> None:
    cls = _ERRORS.get(err.type, OrbitKVError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, err.message)
    if err.field is not None:
        exc.field = err.field  # type: ignore[attr-defined]
    raise exc


def _close_conn(rfile: Any, sock: socket.socket) -> None:
    rfile.close()
    sock.close()


class _Conn:
    __slots__ = ("sock", "rfile", "close", "__weakref__")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = sock.makefile("rb", 1 << 16)
        # Also runs when the thread that owned the connection has ended (its thread-local slot was the
        # last reference): a client used from short-lived threads would otherwise keep one socket, and
        # one server thread, per thread that ever called it.
        self.close = weakref.finalize(self, _close_conn, self.rfile, sock)


class RemoteClient(Client):
    """The client API against an ``orbitkv-cache-manager`` at ``endpoint``. Like a ZeroMQ REQ socket, a
    call made while the server is not (yet) listening waits for it, up to ``timeout`` seconds. Engine calls
    carry the credential of the engine they name (remembered from :meth:`register`, or given with
    :meth:`set_credential`); ``admin_token`` goes with invalidations beyond an engine's own namespace."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout: float = 300.0,
                 admin_token: str | None = None) -> None:
        self.endpoint = endpoint
        self._family, self._addr = _parse_endpoint(endpoint)
        self._timeout = timeout
        self._local = threading.local()
        self._conns: weakref.WeakSet[_Conn] = weakref.WeakSet()  # each is held by its thread's local slot
        self._lock = threading.Lock()
        self._decoders: dict[type, msgspec.msgpack.Decoder] = {}
        self._credentials: dict[str, str] = {}
        self._admin_token = admin_token or ""
        # lease id -> the engine whose lookup took it: a release names it (bounded: an expired lease
        # that nobody restores or releases is forgotten eventually)
        self._lease_engines: collections.OrderedDict[int, str] = collections.OrderedDict()

    def _no_answer(self, why: str = "") -> OrbitKVError:
        return OrbitKVError(f"no answer from the data plane at {self.endpoint} within {self._timeout:g}s{why}")

    def _connect(self, deadline: float, *, wait: bool = True) -> _Conn:
        while True:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.connect(self._addr)
                if self._family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _Conn(sock)
                _handshake(sock, conn.rfile, b"REQ", (b"ROUTER",))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if not wait or time.monotonic() + _RECONNECT_S > deadline:
                    raise self._no_answer(" (nothing listens there)") from None
                time.sleep(_RECONNECT_S)  # not up yet: wait for it, as a ZeroMQ socket would
            except (OSError, EOFError, ProtocolError) as e:
                sock.close()
                raise self._no_answer(f" ({type(e).__name__}: {e})") from None
            except DataPlaneBusy:  # the server said why it will not serve this connection
                sock.close()
                raise
        with self._lock:
            self._conns.add(conn)
        self._local.conn = conn
        return conn

    def _drop(self, conn: _Conn) -> None:
        self._local.conn = None
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _call(self, req: Any, result: type | None) -> Any:
        deadline = time.monotonic() + self._timeout
        msg = _DELIMITER + _frame(_ENC.encode(req))
        conn = getattr(self._local, "conn", None)
        reused = conn is not None
        attempt = 0
        while True:
            # A retry does not wait for a server that is not back yet: that is a dead Manager, not a slow one.
            conn = conn or self._connect(deadline, wait=attempt == 0)
            attempt += 1
            replied = False
            try:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.sock.sendall(msg)
                if not conn.rfile.peek(1):  # no reply byte: the server closed before answering
                    raise EOFError
                replied = True  # from here on the server ran the request: never send it again
                frames = _read_message(conn.rfile)
                break
            except (OSError, EOFError, ProtocolError, ValueError) as e:
                # Timed out or cut off (ValueError: close() from another thread closed its file): the
                # connection's state is unknown, so drop it.
                self._drop(conn)
                conn = None
                if reused and not replied and isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)):
                    # A connection from an earlier call that the server closed before answering (it
                    # restarted, so its state and whatever this request did there are gone, or it dropped
                    # the connection idle): one retry on a new connection is safe and spares the caller a
                    # spurious miss.
                    reused = False
                    continue
                why = "" if isinstance(e, TimeoutError) else f" (connection lost: {type(e).__name__})"
                raise self._no_answer(why) from None
        if len(frames) != 2 or frames[0]:
            self._drop(conn)
            raise OrbitKVError(f"data plane at {self.endpoint}: a reply without the REQ envelope")
        reply = frames[1]
        if reply[:1] == _ERR:
            _raise(msgspec.msgpack.decode(reply[1:], type=WireError))
        if result is None:
            return None
        dec = self._decoders.get(result)
        if dec is None:
            dec = self._decoders[result] = msgspec.msgpack.Decoder(result)
        return dec.decode(reply[1:])

    def ping(self) -> None:
        self._call(Ping(), None)

    def set_credential(self, engine_id: str, credential: str) -> None:
        self._credentials[engine_id] = credential

    def register(self, reg: EngineRegistration) -> EngineInfo:
        info = self._call(Register(reg), EngineInfo)
        self._credentials[info.engine_id] = info.credential
        return info

    def unregister(self, engine_id: str) -> None:
        self._call(Unregister(engine_id, self._credentials.get(engine_id, "")), None)
        self._credentials.pop(engine_id, None)

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        res = self._call(Lookup(engine_id, list(chunks), lease, self._credentials.get(engine_id, "")), LookupResult)
        if res.lease_id:
            with self._lock:
                self._lease_engines[res.lease_id] = engine_id
                if len(self._lease_engines) > _LEASES_REMEMBERED:
                    self._lease_engines.popitem(last=False)
        return res

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks]) -> SaveResult:
        return self._call(Save(engine_id, list(chunks), self._credentials.get(engine_id, "")), SaveResult)

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0,
                layers: Sequence[int] | None = None) -> RestoreResult:
        if lease_id:
            with self._lock:
                self._lease_engines.pop(lease_id, None)
        return self._call(Restore(engine_id, list(chunks), lease_id, None if layers is None else list(layers),
                                  self._credentials.get(engine_id, "")), RestoreResult)

    def release(self, lease_id: int) -> None:
        with self._lock:
            engine_id = self._lease_engines.pop(lease_id, "")
        self._call(Release(lease_id, engine_id, self._credentials.get(engine_id, "")), None)

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False) -> InvalidateResult:
        packed = None if keys is None else [k.pack() for k in keys]
        return self._call(Invalidate(packed, None if chunks is None else list(chunks), namespace, engine_id, all,
                                     self._credentials.get(engine_id or "", ""), self._admin_token),
                          InvalidateResult)

    def stats(self) -> ManagerStats:
        return self._call(Stats(), ManagerStats)

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for c in conns:
            c.close()
        self._local = threading.local()


__all__ = ["DEFAULT_ENDPOINT", "DataPlaneBusy", "DataPlaneLimits", "DataPlaneServer", "DataPlaneStats",
           "ProtocolError", "RemoteClient", "Request", "RequestError",
           "WireError"]
