"""The remote data plane: the client API over a local ZeroMQ socket, msgpack-encoded with msgspec.

Owns the wire protocol between :class:`RemoteClient` (in the engine process) and :class:`DataPlaneServer`
(in ``orbitkv-cache-manager``). KV bytes never cross this socket: the Manager reads and writes the engine's
pages itself (shared-memory file or CUDA IPC); requests carry chunk keys and block ids only.

Wire format: one ZeroMQ frame each way. A request is a msgspec-tagged struct (:data:`Request`); a reply is
one status byte (0 ok, 1 error) then msgpack: the call's result struct, or :class:`WireError` (error class
name, message, field). Sockets: clients use REQ, the server one ROUTER; lookups are answered on the
router's thread, saves and restores on worker threads, so slow saves do not stall lookups.

Invariants: malformed or hostile input gets a typed error reply, never a crash; the server binds only
loopback TCP or ipc:// unless told otherwise; the client re-raises the same error classes the embedded
Manager raises, so both modes behave alike; a remote client is shareable between threads (one socket per
thread) and times out instead of hanging when the server is gone.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import msgspec
import zmq

from . import errors as _errors
from . import geometry as _geometry
from . import manager as _manager
from . import pages as _pages
from .client import Client
from .errors import OrbitKVError
from .keys import ObjectKey
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


class Register(msgspec.Struct, tag="register", array_like=True):
    reg: EngineRegistration


class Unregister(msgspec.Struct, tag="unregister", array_like=True):
    engine_id: str


class Lookup(msgspec.Struct, tag="lookup", array_like=True):
    engine_id: str
    chunks: list[bytes]
    lease: bool = True


class Save(msgspec.Struct, tag="save", array_like=True):
    engine_id: str
    chunks: list[ChunkBlocks]


class Restore(msgspec.Struct, tag="restore", array_like=True):
    engine_id: str
    chunks: list[ChunkBlocks]
    lease_id: int = 0


class Release(msgspec.Struct, tag="release", array_like=True):
    lease_id: int


class Invalidate(msgspec.Struct, tag="invalidate", array_like=True):
    keys: list[bytes] | None = None  # packed ObjectKeys
    chunks: list[bytes] | None = None
    namespace: bytes | None = None
    engine_id: str | None = None
    all: bool = False


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
_REQ_DEC = msgspec.msgpack.Decoder(Request)


def _error_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {}
    for mod in (_errors, _geometry, _manager, _pages):
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, OrbitKVError):
                out[name] = obj
    return out


_ERRORS = _error_classes()


def _check_endpoint(endpoint: str, allow_remote: bool) -> None:
    u = urllib.parse.urlparse(endpoint)
    if u.scheme == "ipc":
        return
    if u.scheme != "tcp":
        raise ValueError(f"data plane endpoint {endpoint!r}: expected ipc:// or tcp://")
    host = u.hostname or ""
    if not allow_remote and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"data plane endpoint {endpoint!r} is not loopback; the data plane has no "
                         "authentication (pass allow_remote to bind it anyway)")


class DataPlaneServer:
    """Serves a :class:`Manager` on ``endpoint`` until :meth:`close`.

    One thread owns the ROUTER socket. Requests that never wait on I/O (ping, stats, release, and lookups
    when there is no lower tier or peer to consult) are answered inline on that thread: no thread hop on
    the latency-critical path. The rest run on ``workers`` threads, which hand their replies back through
    an inproc PUSH/PULL pair (ZeroMQ sockets stay with their threads)."""

    def __init__(self, manager: Manager, endpoint: str = DEFAULT_ENDPOINT, *, workers: int = 4,
                 allow_remote: bool = False) -> None:
        _check_endpoint(endpoint, allow_remote)
        self.manager = manager
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        try:
            self._front.bind(endpoint)
        except zmq.ZMQError as e:
            self._front.close()
            self._ctx.term()
            raise OrbitKVError(f"cannot bind the data plane to {endpoint}: {e}") from None
        self.endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies_addr = f"inproc://dataplane-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self._replies_addr)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dataplane")
        self._local = threading.local()
        self._push_socks: list[zmq.Socket] = []
        self._push_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="dataplane-router", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        try:
            while not self._stop:
                ready = dict(poller.poll(100))
                if self._replies in ready:
                    while True:
                        try:
                            self._front.send_multipart(self._replies.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if self._front in ready:
                    while True:
                        try:
                            frames = self._front.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._route(frames)
            time.sleep(0.01)  # close() stopped the workers first: forward the replies they left
            while True:
                try:
                    self._front.send_multipart(self._replies.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        finally:
            self._front.close(0)
            self._replies.close(0)

    def _route(self, frames: list[bytes]) -> None:
        envelope, msg = frames[:-1], frames[-1]
        try:
            req = _REQ_DEC.decode(msg)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._front.send_multipart(envelope + [_ERR + _ENC.encode(WireError("RequestError",
                                                                                f"malformed request: {e}"))])
            return
        m = self.manager
        inline = isinstance(req, (Ping, Stats, Release)) or (
            isinstance(req, Lookup) and m.lower is None and m.peers is None)
        if inline:
            self._front.send_multipart(envelope + [self._reply(req)])
        else:
            self._pool.submit(self._work, envelope, req)

    def _work(self, envelope: list[bytes], req: Any) -> None:
        reply = self._reply(req)
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replies_addr)
            with self._push_lock:
                self._push_socks.append(sock)
        sock.send_multipart(envelope + [reply])

    def _reply(self, req: Any) -> bytes:
        """One decoded request's reply bytes. Never raises."""
        try:
            return _OK + _ENC.encode(self._dispatch(req))
        except OrbitKVError as e:
            return _ERR + _ENC.encode(WireError(type(e).__name__, _message(e), getattr(e, "field", None)))
        except (ValueError, TypeError) as e:  # bad values that passed the schema (e.g. a 3-byte namespace)
            return _ERR + _ENC.encode(WireError("RequestError", str(e)))
        except Exception as e:  # a bug: report it, keep serving
            log.exception("data plane request %s failed", type(req).__name__)
            return _ERR + _ENC.encode(WireError("OrbitKVError", f"internal error: {type(e).__name__}: {e}"))

    def _dispatch(self, req: Any) -> Any:
        m = self.manager
        if isinstance(req, Lookup):
            return m.lookup(req.engine_id, req.chunks, lease=req.lease)
        if isinstance(req, Save):
            return m.save(req.engine_id, req.chunks)
        if isinstance(req, Restore):
            return m.restore(req.engine_id, req.chunks, lease_id=req.lease_id)
        if isinstance(req, Release):
            m.release(req.lease_id)
            return None
        if isinstance(req, Register):
            return m.register_engine(req.reg)
        if isinstance(req, Unregister):
            m.unregister_engine(req.engine_id)
            return None
        if isinstance(req, Invalidate):
            keys = None if req.keys is None else [ObjectKey.unpack(k) for k in req.keys]
            return m.invalidate(keys=keys, chunks=req.chunks, namespace=req.namespace, engine_id=req.engine_id,
                                all=req.all)
        if isinstance(req, Stats):
            return m.stats()
        return None  # Ping

    def close(self) -> None:
        """Stop serving: in-flight requests finish, the sockets close."""
        self._pool.shutdown(wait=True)
        self._stop = True
        self._thread.join(timeout=10)
        with self._push_lock:
            for sock in self._push_socks:
                sock.close(0)
        self._ctx.term()


def _message(e: BaseException) -> str:
    return str(e.args[0]) if len(e.args) == 1 and isinstance(e, KeyError) else str(e)


def _raise(err: WireError) -> None:
    cls = _ERRORS.get(err.type, OrbitKVError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, err.message)
    if err.field is not None:
        exc.field = err.field  # type: ignore[attr-defined]
    raise exc


class RemoteClient(Client):
    """The client API against an ``orbitkv-cache-manager`` at ``endpoint``."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout: float = 300.0) -> None:
        self.endpoint = endpoint
        self._timeout_ms = int(timeout * 1000)
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._decoders: dict[type, msgspec.msgpack.Decoder] = {}

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            s.connect(self.endpoint)
            self._local.sock = s
            with self._lock:
                self._socks.append(s)
        return s

    def _call(self, req: Any, result: type | None) -> Any:
        s = self._sock()
        try:
            s.send(_ENC.encode(req))
            reply = s.recv()
        except zmq.Again:
            # A REQ socket that missed its reply is stuck: drop it, the next call makes a new one.
            self._local.sock = None
            with self._lock:
                self._socks.remove(s)
            s.close(0)
            raise OrbitKVError(f"no answer from the data plane at {self.endpoint} within "
                               f"{self._timeout_ms / 1000:g}s") from None
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

    def register(self, reg: EngineRegistration) -> EngineInfo:
        return self._call(Register(reg), EngineInfo)

    def unregister(self, engine_id: str) -> None:
        self._call(Unregister(engine_id), None)

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        return self._call(Lookup(engine_id, list(chunks), lease), LookupResult)

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks]) -> SaveResult:
        return self._call(Save(engine_id, list(chunks)), SaveResult)

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0) -> RestoreResult:
        return self._call(Restore(engine_id, list(chunks), lease_id), RestoreResult)

    def release(self, lease_id: int) -> None:
        self._call(Release(lease_id), None)

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False) -> InvalidateResult:
        packed = None if keys is None else [k.pack() for k in keys]
        return self._call(Invalidate(packed, None if chunks is None else list(chunks), namespace, engine_id, all),
                          InvalidateResult)

    def stats(self) -> ManagerStats:
        return self._call(Stats(), ManagerStats)

    def close(self) -> None:
        with self._lock:
            for s in self._socks:
                s.close(0)
            self._socks.clear()
        self._ctx.term()


__all__ = ["DEFAULT_ENDPOINT", "DataPlaneServer", "RemoteClient", "Request", "RequestError", "WireError"]
