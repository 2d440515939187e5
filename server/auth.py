"""Bearer-token protection of the mutating and admin endpoints, and the bind-address policy.

Owns :func:`check_bind` (the start-up rule), :func:`require_admin` (the FastAPI dependency mutating and
admin routes declare) and :class:`SameOrigin` (the browser guard). :class:`AdminToken` (holds the secret;
its ``repr`` never shows it) and :func:`is_loopback` live in :mod:`orbitkv_fs.access`: the data plane and
the peer port apply the same rules.

Policy (safe by default):

* Loopback bind and no token: the control plane is open to local processes only.
* A token configured (``--admin-token`` or ``ORBITKV_ADMIN_TOKEN``): every mutating and admin endpoint
  needs ``Authorization: Bearer <token>``, whatever the bind address.
* A non-loopback bind needs a token: :func:`check_bind` raises :class:`InsecureBind` and the Manager does
  not start.
* Browsers: a mutating request (any method but GET, HEAD, OPTIONS) carrying a foreign ``Origin`` (or
  ``Sec-Fetch-Site: cross-site``/``same-site``) is refused 403 ``cross_origin``, token or not: without a
  token a web page could otherwise drive the API with a "simple" cross-site request that needs no
  preflight. On a loopback bind every request must name a loopback host (``Host: 127.0.0.1:9091``,
  ``localhost``, ``[::1]``), or it is refused 403 ``bad_host``: a DNS-rebound page names its own.

Invariants: tokens are compared with :func:`hmac.compare_digest` over equal-length digests (no early exit,
no length oracle); a token never appears in a log line, a ``repr`` or an error body.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orbitkv_fs.access import MIN_TOKEN_LENGTH, AdminToken, InsecureBind, is_loopback

from .errors import ApiError, error_response

__all__ = ["AdminToken", "InsecureBind", "MIN_TOKEN_LENGTH", "SameOrigin", "bearer", "check_bind", "is_loopback",
           "require_admin"]


def check_bind(host: str, token: AdminToken | None) -> None:
    """The start-up rule: a non-loopback address needs an admin token. Raises :class:`InsecureBind`."""
    if token is None and not is_loopback(host):
        raise InsecureBind(f"refusing to serve the control plane on non-loopback address {host!r} without an "
                           "admin token; pass --admin-token or set ORBITKV_ADMIN_TOKEN (or bind 127.0.0.1)")


bearer = HTTPBearer(auto_error=False, description="the admin token (--admin-token / ORBITKV_ADMIN_TOKEN)")


async def require_admin(request: Request,
                        credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    """Dependency of every mutating and admin route: passes when no token is configured (loopback only,
    see :func:`check_bind`) or when the request carries the token."""
    token: AdminToken | None = request.app.state.admin_token
    if token is None:
        return
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise ApiError(401, "unauthorized", "this endpoint needs 'Authorization: Bearer <admin token>'",
                       headers=challenge)
    if not token.matches(credentials.credentials):
        raise ApiError(401, "unauthorized", "the bearer token is not the admin token", headers=challenge)


_SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")


class SameOrigin:
    """ASGI middleware: the browser rules of the module docstring. ``loopback``: the server binds a
    loopback address (then the Host header must name one too)."""

    def __init__(self, app: Any, loopback: bool) -> None:
        self.app = app
        self.loopback = loopback

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.loopback and not _loopback_host(host):
            await error_response(403, "bad_host", "this control plane answers only requests to a loopback host "
                                 "name (127.0.0.1, localhost, [::1])")(scope, receive, send)
            return
        if scope["method"].encode() not in _SAFE_METHODS:
            origin = headers.get(b"origin")
            site = headers.get(b"sec-fetch-site", b"")
            foreign = origin is not None and origin.decode("latin-1") != f"{scope.get('scheme', 'http')}://{host}"
            if foreign or site in (b"cross-site", b"same-site"):
                await error_response(403, "cross_origin", "a cross-origin (browser) request may not change "
                                     "anything here")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _loopback_host(host: str) -> bool:
    """``host`` (a Host header: name or address, optional port) names this machine's loopback."""
    if host.startswith("["):  # an IPv6 literal, as a Host header writes it
        name = host[1:host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0]
    name = name.lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
