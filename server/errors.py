"""Every HTTP error is a JSON body ``{"code": ..., "message": ...}``: the mapping from failures to answers.

Owns :class:`ApiError` (raise it from a route for a chosen status and code), :class:`ErrorBody` (the
body's schema, declared on every route so the OpenAPI document tells the truth), the table from the
Manager's typed errors to HTTP statuses (:data:`MANAGER_ERRORS`), :func:`install` (the exception
handlers) and :class:`UnhandledErrors` (the last-resort 500). Codes are stable snake_case strings; messages are for people.

Invariants: no handler echoes a request header (tokens never reach a body or a log line); an unexpected
exception is answered ``500 internal`` without internals (its traceback goes to the log); validation errors
name the offending field.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from orbitkv_fs.access import AccessDenied, HandleInUse
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.geometry import GeometryError
from orbitkv_fs.manager import EngineBusy, LeaseError, PoolExhausted, RequestError, TooManyEngines, UnknownEngine

log = logging.getLogger("orbitkv.http")

__all__ = ["ApiError", "ErrorBody", "MANAGER_ERRORS", "UnhandledErrors", "error_response", "install", "responses"]


class ErrorBody(BaseModel):
    """The body of every error answer."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="stable machine-readable error code, e.g. unknown_engine")
    message: str = Field(description="what went wrong, for people")
    field: str | None = Field(default=None, description="the offending request field, when one is to blame")


class ApiError(Exception):
    """An error answer chosen by a route: ``status`` with body ``{code, message[, field]}``."""

    def __init__(self, status: int, code: str, message: str, *, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


#: Manager error class -> (HTTP status, code). Checked in order: subclasses first.
MANAGER_ERRORS: tuple[tuple[type[Exception], int, str], ...] = (
    (GeometryError, 422, "invalid_registration"),
    (HandleInUse, 409, "handle_in_use"),
    (AccessDenied, 403, "forbidden"),
    (UnknownEngine, 404, "unknown_engine"),
    (EngineBusy, 409, "engine_busy"),
    (TooManyEngines, 429, "too_many_engines"),
    (LeaseError, 409, "unknown_lease"),
    (PoolExhausted, 503, "pool_exhausted"),
    (RequestError, 422, "invalid_request"),
    (OrbitKVError, 400, "bad_request"),
)

_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 406: "not_acceptable", 409: "conflict", 411: "length_required",
                 413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_request",
                 429: "too_many_requests", 500: "internal", 503: "unavailable"}


def error_response(status: int, code: str, message: str, *, field: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    first_field = None
    for err in exc.errors()[:5]:
        where = _field_path(err.get("loc", ()))
        first_field = first_field or where
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    more = len(exc.errors()) - 5
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts) or "invalid request", first_field


def _missing_body(request: Request, exc: RequestValidationError) -> str | None:
    """The message for a request that sent no body where the route takes one (pydantic says only
    "Field required", naming no field), or None."""
    errors = exc.errors()
    if len(errors) != 1 or errors[0].get("type") != "missing" or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    body = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    name = getattr(model, "__name__", "JSON object")
    return (f"request body missing: {request.method} {request.url.path} takes a JSON {name} "
            "(its schema is in /openapi.json; send it with Content-Type: application/json)")


def _field_path(loc: tuple | list) -> str | None:
    """``("body", "tensors", 0, "handle", "host", "name")`` -> ``tensors[0].handle.name``: the field as the
    client wrote it (pydantic adds the union member's tag, which is not in the request)."""
    out = ""
    items = list(loc)
    if items and items[0] == "body":
        items = items[1:]
    for i, x in enumerate(items):
        if isinstance(x, int):
            out += f"[{x}]"
        elif i > 0 and items[i - 1] == "handle" and x in ("host", "cuda_ipc"):
            continue
        else:
            out += f".{x}" if out else str(x)
    return out or None


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an :class:`ErrorBody`."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, field=exc.field, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        missing = _missing_body(request, exc)
        if missing is not None:
            return error_response(422, "invalid_request", missing, field="body")
        message, field = _validation_message(exc)
        return error_response(422, "invalid_request", message, field=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(OrbitKVError)
    async def _manager(_: Request, exc: OrbitKVError) -> JSONResponse:
        for cls, status, code in MANAGER_ERRORS:
            if isinstance(exc, cls):
                # KeyError subclasses quote their str(); the message is the first argument.
                message = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
                return error_response(status, code, message, field=getattr(exc, "field", None))
        raise AssertionError("unreachable: OrbitKVError is in the table")

    app.add_middleware(UnhandledErrors)


class UnhandledErrors:
    """ASGI middleware: an exception no handler took is logged with its traceback and answered
    ``500 internal``. It is not re-raised: the server would then drop the keep-alive connection under a
    client that was promised it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise  # half an answer is out: only closing the connection can signal the failure
            await error_response(500, "internal", "internal error; see the manager's log")(scope, receive, send)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting ``statuses`` as :class:`ErrorBody` answers."""
    return {s: {"model": ErrorBody, "description": _STATUS_CODES.get(s, "error").replace("_", " ")}
            for s in statuses}
