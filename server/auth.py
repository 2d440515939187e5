"""Bearer-token protection of the mutating and admin endpoints, and the bind-address policy.

Owns :class:`AdminToken` (holds the secret; its ``repr`` never shows it), :func:`is_loopback` (is an
address loopback-only), :func:`check_bind` (the start-up rule) and :func:`require_admin` (the FastAPI
dependency mutating and admin routes declare).

Policy (safe by default):

* Loopback bind and no token: the control plane is open to local processes only.
* A token configured (``--admin-token`` or ``ORBITKV_ADMIN_TOKEN``): every mutating and admin endpoint
  needs ``Authorization: Bearer <token>``, whatever the bind address.
* A non-loopback bind needs a token: :func:`check_bind` raises :class:`InsecureBind` and the Manager does
  not start.

Invariants: tokens are compared with :func:`hmac.compare_digest` over equal-length digests (no early exit,
no length oracle); a token never appears in a log line, a ``repr`` or an error body.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orbitkv_fs.errors import OrbitKVError

from .errors import ApiError

__all__ = ["AdminToken", "InsecureBind", "bearer", "check_bind", "is_loopback", "require_admin"]

#: Shorter tokens are refused: a guessable admin token is no protection.
MIN_TOKEN_LENGTH = 16


class InsecureBind(OrbitKVError, ValueError):
    """A non-loopback bind address without an admin token, or a token too weak to use."""


class AdminToken:
    """The configured admin token. Only :meth:`matches` reads it."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        if len(token) < MIN_TOKEN_LENGTH or not token.isprintable() or token != token.strip():
            raise InsecureBind(f"the admin token must be at least {MIN_TOKEN_LENGTH} printable characters "
                               "without surrounding spaces")
        self._digest = hashlib.sha256(token.encode()).digest()

    def matches(self, presented: str) -> bool:
        """Constant-time comparison (of SHA-256 digests, so lengths leak nothing either)."""
        return hmac.compare_digest(self._digest, hashlib.sha256(presented.encode()).digest())

    def __repr__(self) -> str:
        return "AdminToken(***)"


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP literal or a name) resolves only to loopback addresses."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


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
