"""The HTTP control plane: registration, invalidation, metrics and admin over FastAPI, safe by default.

Owns the routes and :func:`create_app` (a FastAPI app over one :class:`~orbitkv_fs.manager.Manager`),
:class:`BodyLimit` (the request-size guard), :class:`HttpServer` (uvicorn in a thread, what
``orbitkv-cache-manager`` and the tests run) and :func:`parse_http_addr`. The data path (lookup, save,
restore) is not here: it is the ZeroMQ data plane (:mod:`orbitkv_fs.dataplane`).

Endpoints (OpenAPI at ``/docs``, ``/openapi.json``); *admin* ones need the bearer token when one is
configured (:mod:`.auth`):

====================================  =====  ===============================================================
``POST /v1/engines``                  admin  register an engine's geometry and handles -> 201 ``EngineOut``
``GET /v1/engines``, ``/{id}``               registered engines
``DELETE /v1/engines/{id}``           admin  unregister; waits for the engine's outstanding work -> 204
``POST /v1/invalidate``               admin  drop keys / a namespace / an engine's namespace / everything
``GET /metrics``                             Prometheus text (:mod:`.metrics`)
``GET /v1/stats``                            the same facts as JSON (``ManagerStats`` + peer stats)
``GET /healthz``, ``/readyz``                liveness; readiness (503 while starting or stopping)
``GET /v1/config``                           the Manager's settings and the HTTP policy in force
``POST /v1/admin/flush-dram``         admin  demote every unleased DRAM object to the lower tier
``GET /v1/objects``                   admin  paginated listing of cached objects
``/v1/peers...``                      admin  peer registry (:mod:`.peers_api`; GETs are open; only
                                             with peer sharing on, else 404 ``peers_off``)
====================================  =====  ===============================================================

Invariants: every error is ``{code, message[, field]}`` (:mod:`.errors`); request bodies are bounded
(:data:`DEFAULT_MAX_BODY_BYTES`) and strictly validated (:mod:`.models`); no endpoint takes a file-system
path -- a host-pages handle names a regular file directly inside the Manager's ``--shm-dir`` (no
symlinks, FIFOs or devices) that belongs to the OS user of the requesting connection (root excepted), and
the Manager maps a registration's handles for that engine alone, closing them when it unregisters; memory a
registered engine holds cannot be registered again under any name (409 ``handle_in_use``, decided by the
Manager from the file's identity); the registration's answer alone carries the engine's credential;
browsers cannot drive it (:class:`~.auth.SameOrigin`); the access log never writes a query string; blocking
Manager calls run in the threadpool, never on the event loop.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import threading
import time
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from orbitkv_fs.access import Caller, tcp_peer_uid
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.geometry import GeometryError
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.manager import EngineInfo, Manager, ManagerStats
from orbitkv_fs.peers.stats import PeerStats
from orbitkv_fs.segment import Role

from . import errors
from .auth import AdminToken, SameOrigin, bearer, check_bind, is_loopback, require_admin
from .connections import LISTEN_QUEUE, AcceptFailures, ConnectionGuard, HttpLimits, limited_protocol
from .errors import ApiError, responses
from .metrics import build_registry
from .models import (
    ENGINE_REF,
    HEX16,
    MAX_OBJECTS_PAGE,
    ConfigOut,
    EngineList,
    EngineOut,
    FlushOut,
    HealthOut,
    HttpConfigOut,
    InvalidateOut,
    InvalidateRequest,
    ObjectPageOut,
    ReadyOut,
    RegisteredOut,
    RegisterRequest,
    TierCountsOut,
    model_of_struct,
)

__all__ = ["BodyLimit", "DEFAULT_MAX_BODY_BYTES", "HttpServer", "HttpServerError", "create_app", "parse_http_addr"]

#: Request bodies above this are refused with 413 before they are parsed (a registration of 8192
#: tensors is about 2.5 MB of JSON).
DEFAULT_MAX_BODY_BYTES = 4 << 20

_CURSOR = r"^(dram|lower):[0-9a-f]{0,72}$"


class HttpServerError(OrbitKVError):
    """The HTTP server could not start (address in use, bad address)."""


# ---------------------------------------------------------------------------------------------- body limit


class BodyLimit:
    """ASGI middleware: a request whose Content-Length, or whose streamed body, exceeds ``max_bytes`` is
    answered 413 ``payload_too_large`` (nothing past the limit is buffered)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            resp = errors.error_response(413, "payload_too_large",
                                         f"request body over {self.max_bytes} bytes" if length.isdigit()
                                         else "bad Content-Length")
            await resp(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI lets HTTPException through its body parsing; the handler answers 413.
                    raise HTTPException(413, f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


# ---------------------------------------------------------------------------------------------- helpers


def _manager(request: Request) -> Manager:
    return request.app.state.manager


def _engine_out(info: EngineInfo) -> EngineOut:
    r = info.registration
    return EngineOut(engine_id=info.engine_id, namespace=info.namespace, codec=info.codec, model=info.model,
                     model_revision=r.model_revision, engine_kind=r.engine_kind, num_layers=r.num_layers,
                     layer_start=info.layer_start, layer_end=info.layer_end, block_size=r.block_size,
                     num_heads=r.num_heads, head_dim=r.head_dim, dtype=r.dtype, num_blocks=info.num_blocks,
                     tensors=len(r.tensors), segments_per_chunk=info.segments_per_chunk,
                     exact_layers=list(info.exact_layers), device=info.device, tp_rank=r.tp_rank,
                     tp_size=r.tp_size, pp_rank=r.pp_rank, pp_size=r.pp_size, pid=r.pid, watched=info.watched)


def _shm_resolver(shm_dir: str):
    """``(name, field) -> path`` of a shared-memory object inside ``shm_dir``: a regular file, reached
    without following a symlink. Opening a FIFO or device would block or touch hardware; a symlink would
    let a name reach outside the directory."""
    base = os.path.realpath(shm_dir)

    def resolve(name: str, field: str) -> str:
        path = os.path.join(base, name)
        if os.path.dirname(path) != base:  # the model's pattern already forbids this; never trust one layer
            raise GeometryError(field, "a handle names a shared-memory object, not a path")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise GeometryError(field, f"no shared-memory object {name!r} in the Manager's shm directory") from None
        except OSError as e:
            raise GeometryError(field, f"cannot inspect shared-memory object {name!r}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise GeometryError(field, f"shared-memory object {name!r} is not a regular file")
        return path

    return resolve


def _requester(request: Request) -> Caller:
    """The registrant of a REST registration: the OS user of the requesting loopback connection (the
    Manager maps only that user's pages files), looked up when the Manager asks."""
    client, server = request.scope.get("client"), request.scope.get("server")

    def uid() -> int | None:
        if not client or not server:
            return None
        return tcp_peer_uid((server[0], server[1]), (client[0], client[1]))

    return Caller(uid_of=uid)


def _no_query(record: logging.LogRecord) -> bool:
    """uvicorn.access filter: the path without its query string (a ``?token=`` must not reach the log)."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
        record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
    return True


def _key(text: str, field: str) -> ObjectKey:
    """An object key as /v1/objects prints it (the model checked the shape; the layer range is checked here)."""
    ns, chunk, layer, role = text.split("/")
    try:
        return ObjectKey(bytes.fromhex(ns), bytes.fromhex(chunk), int(layer[1:]), Role.parse(role))
    except ValueError as e:
        raise ApiError(422, "invalid_request", f"{field}: {e}", field=field) from None


# ---------------------------------------------------------------------------------------------- the app


def create_app(manager: Manager, *, admin_token: AdminToken | None = None, address: str = "127.0.0.1:9091",
               peer_node: Any = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               dataplane: Any = None, http_limits: HttpLimits | None = None,
               lower_tier_wanted: str | None = None) -> FastAPI:
    """The control plane of ``manager``. ``address`` is what the server binds (checked here too: a
    non-loopback address without ``admin_token`` raises :class:`~.auth.InsecureBind`). ``peer_node`` is the
    process's :class:`~orbitkv_fs.peers.PeerNode` or None; ``dataplane`` its
    :class:`~orbitkv_fs.dataplane.DataPlaneServer` (its limits and counters go to ``/metrics``) or None;
    ``http_limits`` bound the connections of the :class:`HttpServer` that serves the app (:mod:`.connections`);
    ``lower_tier_wanted`` names the lower tier the flags asked for (``"ssd"``), so that ``/readyz`` and ``/metrics``
    say when the Manager serves without it."""
    host, _ = parse_http_addr(address)
    check_bind(host, admin_token)
    app = FastAPI(title="OrbitKV-FS cache manager", version="1",
                  description="Control plane of one orbitkv-cache-manager: engine registration, invalidation, "
                              "metrics and admin. Mutating and admin endpoints need `Authorization: Bearer "
                              "<admin token>` when the manager has one (always on a non-loopback address). "
                              "Every error is a JSON body `{code, message}`.")
    app.state.manager = manager
    app.state.admin_token = admin_token
    app.state.peer_node = peer_node
    app.state.ready = True
    app.state.http_guard = guard = ConnectionGuard(http_limits)
    registry = build_registry(manager, (lambda: peer_node.stats()) if peer_node is not None else None,
                              dataplane.stats if dataplane is not None else None, guard.stats, lower_tier_wanted)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(SameOrigin, loopback=is_loopback(host))
    resolve = _shm_resolver(manager.config().shm_dir)
    admin = [Depends(require_admin)]
    cache: dict = {}
    StatsOut = model_of_struct(ManagerStats, cache, name="StatsOut",
                               extra={"peers": (model_of_struct(PeerStats, cache) | None, None)})

    # -- engines ---------------------------------------------------------------------------------------

    @app.post("/v1/engines", status_code=201, response_model=RegisteredOut, dependencies=admin, tags=["engines"],
              responses=responses(400, 401, 403, 409, 413, 422, 429))
    def register_engine(body: RegisterRequest, request: Request, response: Response) -> RegisteredOut:
        """Register an engine's tensor geometry and handles. The Manager maps the handles (host pages by
        shared-memory object name -- a file of the requesting user --, or CUDA IPC) for this engine only and
        checks every tensor against its descriptor: 422 ``invalid_registration`` naming the field on any
        mismatch, nothing registered. Memory another registered engine holds, under any name, is refused
        (409 ``handle_in_use``); a registration over its OS user's quota of engines or tensors is 429
        ``too_many_engines``. The answer carries the engine's ``credential``: every data-plane call for the
        engine must present it, and no other answer shows it."""
        reg = body.to_registration(resolve)
        info = _manager(request).register_engine(reg, caller=_requester(request))
        response.headers["Location"] = f"/v1/engines/{info.engine_id}"
        return RegisteredOut(**_engine_out(info).model_dump(), credential=info.credential)

    @app.get("/v1/engines", response_model=EngineList, tags=["engines"])
    def list_engines(request: Request) -> EngineList:
        return EngineList(engines=[_engine_out(i) for i in _manager(request).list_engines()])

    engine_path = Path(pattern=ENGINE_REF, max_length=128, description="engine id")

    @app.get("/v1/engines/{engine_id}", response_model=EngineOut, tags=["engines"], responses=responses(404, 422))
    def get_engine(request: Request, engine_id: str = engine_path) -> EngineOut:
        return _engine_out(_manager(request).get_engine(engine_id))

    @app.delete("/v1/engines/{engine_id}", status_code=204, dependencies=admin, tags=["engines"],
                response_class=Response, responses={204: {"description": "unregistered"},
                                                    **responses(401, 404, 409, 422)})
    def unregister_engine(request: Request, engine_id: str = engine_path,
                          timeout_s: float = Query(60.0, gt=0, le=600,
                                                   description="how long to wait for outstanding work (409 after)")
                          ) -> Response:
        """Refuse new requests for the engine, wait for its outstanding ones, release its leases, codec
        resources and mapped handles. Its cached objects stay (they belong to its namespace)."""
        _manager(request).unregister_engine(engine_id, timeout=timeout_s)
        return Response(status_code=204)

    # -- invalidate ------------------------------------------------------------------------------------

    @app.post("/v1/invalidate", response_model=InvalidateOut, dependencies=admin, tags=["cache"],
              responses=responses(400, 401, 404, 413, 422))
    def invalidate(body: InvalidateRequest, request: Request) -> InvalidateOut:
        """Drop objects from every tier. Leased objects are hidden at once and freed when their leases drain."""
        m = _manager(request)
        chunks = [bytes.fromhex(c) for c in body.chunks] if body.chunks is not None else None
        keys = [_key(k, f"keys[{i}]") for i, k in enumerate(body.keys)] if body.keys is not None else None
        res = m.invalidate(keys=keys,
                           chunks=chunks,
                           namespace=bytes.fromhex(body.namespace) if body.namespace is not None else None,
                           engine_id=body.engine_id, all=body.all)
        tiers = {"dram": TierCountsOut(objects=res.dram.objects, bytes=res.dram.bytes)}
        if m.lower is not None:
            tiers[getattr(m.lower, "name", "lower")] = TierCountsOut(objects=res.lower.objects, bytes=res.lower.bytes)
        return InvalidateOut(tiers=tiers, objects=sum(t.objects for t in tiers.values()),
                             bytes=sum(t.bytes for t in tiers.values()))

    # -- observability ---------------------------------------------------------------------------------

    @app.get("/metrics", response_class=PlainTextResponse, tags=["observability"],
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats", response_model=StatsOut, tags=["observability"])
    def stats(request: Request) -> Response:
        """The facts ``/metrics`` exports, as one JSON snapshot."""
        out = msgspec.to_builtins(_manager(request).stats())
        out["peers"] = msgspec.to_builtins(peer_node.stats()) if peer_node is not None else None
        return Response(msgspec.json.encode(out), media_type="application/json")

    @app.get("/healthz", response_model=HealthOut, tags=["observability"])
    def healthz() -> HealthOut:
        """The process answers."""
        return HealthOut(status="ok")

    @app.get("/readyz", response_model=ReadyOut, tags=["observability"], responses=responses(503))
    def readyz(request: Request) -> ReadyOut:
        """Ready to register engines and serve (503 ``not_ready`` while starting or shutting down)."""
        if not request.app.state.ready:
            raise ApiError(503, "not_ready", "the manager is starting or shutting down")
        m = _manager(request)
        return ReadyOut(status="ready", engines=m.stats().engines,
                        lower_tier=getattr(m.lower, "name", "lower") if m.lower is not None else None,
                        lower_tier_missing=lower_tier_wanted if m.lower is None else None,
                        peers=peer_node is not None)

    @app.get("/v1/config", response_model=ConfigOut, tags=["observability"])
    def config(request: Request) -> ConfigOut:
        m = _manager(request)
        return ConfigOut(manager=msgspec.to_builtins(m.config()),
                         http=HttpConfigOut(address=address, auth_required=admin_token is not None,
                                            max_body_bytes=max_body_bytes,
                                            max_connections=guard.limits.max_connections,
                                            request_timeout_s=guard.limits.request_timeout_s),
                         lower_tier=getattr(m.lower, "name", "lower") if m.lower is not None else None,
                         peers=peer_node is not None)

    # -- admin -----------------------------------------------------------------------------------------

    @app.post("/v1/admin/flush-dram", response_model=FlushOut, dependencies=admin, tags=["admin"],
              responses=responses(401))
    def flush_dram(request: Request) -> FlushOut:
        """Demote every unleased DRAM object to the lower tier and wait for the writeback (without a lower
        tier the objects are dropped)."""
        r = _manager(request).flush_dram()
        return FlushOut(submitted=TierCountsOut(objects=r.submitted.objects, bytes=r.submitted.bytes),
                        dropped=TierCountsOut(objects=r.dropped.objects, bytes=r.dropped.bytes),
                        skipped_leased=r.skipped_leased, complete=r.complete)

    @app.get("/v1/objects", response_model=ObjectPageOut, dependencies=admin, tags=["admin"],
             responses=responses(401, 422))
    def list_objects(request: Request,
                     namespace: str | None = Query(None, pattern=HEX16, description="hex storage namespace"),
                     prefix: str = Query("", pattern=r"^[0-9a-f]{0,32}$", description="hex prefix of the chunk key"),
                     limit: int = Query(100, ge=1, le=MAX_OBJECTS_PAGE),
                     cursor: str | None = Query(None, pattern=_CURSOR, max_length=80,
                                                description="next_cursor of the previous page")) -> Any:
        """Cached objects (DRAM first, then the lower tier) in key order, one page at a time."""
        page = _manager(request).list_objects(bytes.fromhex(namespace) if namespace else None, prefix, limit,
                                              cursor)
        rows = msgspec.to_builtins(page.objects)
        lower = _manager(request).lower
        for row in rows:  # the Manager says "lower"; operators see the tier's name, as in /v1/invalidate
            if row["tier"] == "lower" and lower is not None:
                row["tier"] = getattr(lower, "name", "lower")
        return {"objects": rows, "next_cursor": page.next_cursor}

    # -- peers -----------------------------------------------------------------------------------------

    if peer_node is not None:
        from .peers_api import router as peers_router

        app.include_router(peers_router, dependencies=[Depends(_admin_if_mutating)], responses=responses(401, 503))
    else:
        # Not in the schema: the routes do not exist in this process. Say why instead of a bare 404.
        @app.api_route("/v1/peers{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
        def peers_off() -> None:
            raise ApiError(404, "peers_off", "peer sharing is off (start with --peer or --peer-port)")

    _document_auth(app, admin_token is not None)
    return app


def _document_auth(app: FastAPI, enforced: bool) -> None:
    """The OpenAPI document states the auth in force: without a token nothing needs one, so the bearer
    scheme and the 401 answers are left out rather than promised."""
    if enforced:
        return
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.pop("security", None)
                    op.get("responses", {}).pop("401", None)
            schema.get("components", {}).pop("securitySchemes", None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _admin_if_mutating(request: Request,
                             credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    """The peer routes: mutations need the admin token, reads do not."""
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        await require_admin(request, credentials)


# ---------------------------------------------------------------------------------------------- serving


def parse_http_addr(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port). Raises ValueError."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", text.strip())
    if not m:
        raise ValueError(f"bad HTTP address {text!r}; use host:port, e.g. 127.0.0.1:9091")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if port > 65535:
        raise ValueError(f"bad port in {text!r}")
    return host, port


class HttpServer:
    """uvicorn serving ``app`` in a background thread. :meth:`start` returns once it listens (port 0
    picks a free port: see :attr:`port`); :meth:`close` stops accepting, finishes in-flight requests
    (up to ``graceful_s``) and joins. Its connections are bounded by the app's guard (:mod:`.connections`;
    an app not made by :func:`create_app` gets the default limits)."""

    def __init__(self, app: FastAPI, host: str, port: int, *, log_level: str = "warning",
                 access_log: bool = False, graceful_s: float = 10.0) -> None:
        import uvicorn

        self.app = app
        self.host = host
        guard = getattr(app.state, "http_guard", None) or ConnectionGuard()
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                                     access_log=access_log, lifespan="off",
                                                     log_config=None,  # the process's logging setup applies
                                                     timeout_graceful_shutdown=graceful_s,
                                                     server_header=False, http=limited_protocol(guard), ws="none",
                                                     backlog=guard.limits.backlog))
        aio = logging.getLogger("asyncio")
        if not any(isinstance(f, AcceptFailures) for f in aio.filters):
            aio.addFilter(AcceptFailures())
        if access_log:  # uvicorn cuts the access logger off for servers without one; undo it for this one
            access = logging.getLogger("uvicorn.access")
            access.propagate = True
            if _no_query not in access.filters:
                access.addFilter(_no_query)
        self._thread = threading.Thread(target=self._run, name="orbitkv-http", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run()
        except BaseException as e:  # uvicorn exits (SystemExit) when it cannot bind
            self._error = e

    def start(self, timeout: float = 15.0) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                why = repr(self._error) if self._error is not None else "see the log"
                raise HttpServerError(f"the HTTP server did not start on {self.host} ({why})")
            time.sleep(0.01)
        # asyncio accepts as many connections in one go as the backlog it listened with (a quarter of the
        # connection limit, :mod:`.connections`); the kernel's queue may hold more, so that a flood fills it
        # less often (a full queue drops SYNs: a client's connect then waits a second for its retry).
        for srv in self._server.servers:
            for ts in srv.sockets:
                sock = socket.socket(fileno=ts.fileno())
                try:
                    sock.listen(LISTEN_QUEUE)
                finally:
                    sock.detach()  # the descriptor stays the server's
        return self

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self.app.state.ready = False
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
