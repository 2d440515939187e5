"""Who may act on what: engine credentials, the admin token, the OS user behind a connection, and what a
registration may name. The threat model these pieces enforce is docs/security.md.

Primitives:

* :class:`Caller` -- who a data-plane call comes from: the credential it carries and, looked up only
  when needed, the OS user of its connection (:func:`socket_uid`). ``None`` instead of a Caller means a
  trusted in-process caller (the HTTP control plane after its own checks, the peer server, tests).
* :func:`issue_credential` / :func:`authorize` -- a per-engine secret handed out once, at registration,
  and the check every engine call passes through (the Manager calls it under its lock).
* :class:`AdminToken` -- the operator's token (HTTP bearer, data-plane admin acts); compared in constant
  time over digests, never shown.
* :func:`open_pages_file` -- opens what a host-pages handle names only if it is a regular file directly
  inside the Manager's shared-memory directory (symlinks resolved, never followed out of it), owned by the
  registering user; answers the descriptor the Manager maps, so nothing can be swapped in between.
* :class:`HandleClaims` -- which engine holds which memory, by identity (``st_dev``/``st_ino`` of a pages
  file, the bytes of a CUDA IPC handle and the byte extent inside it), never by path: a hard link or a
  second name of a registered engine's pages is the same memory and is refused.
* :func:`socket_uid` / :func:`tcp_peer_uid` -- the OS user of a connection's other end: ``SO_PEERCRED`` on
  a Unix socket, the socket owner the kernel lists in ``/proc/net/tcp[6]`` for a loopback TCP connection.

Errors: :class:`AccessDenied` (base), :class:`Unauthenticated` (an engine call without that engine's
credential), :class:`AdminRequired` (an act beyond one engine's own namespace without the admin token),
:class:`HandleInUse` (a registration naming memory another engine holds).

Invariants: secrets are compared with :func:`hmac.compare_digest` and never logged or echoed except to the
registrant, once; a registration that names anything but a regular file of the registrant inside the
shared-memory directory is refused before a byte of it is mapped; one piece of memory is held by at most
one engine.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import struct
import sys
from typing import Callable, Iterable

from .errors import OrbitKVError
from .geometry import GeometryError

__all__ = [
    "AccessDenied", "AdminRequired", "AdminToken", "Caller", "HandleClaims", "HandleInUse", "InsecureBind",
    "MIN_TOKEN_LENGTH", "is_loopback",
    "Unauthenticated", "authorize", "file_identity", "in_process_caller", "issue_credential", "open_pages_file",
    "socket_uid", "tcp_peer_uid",
]

#: Shorter admin tokens are refused: a guessable token is no protection.
MIN_TOKEN_LENGTH = 16
_CREDENTIAL_BYTES = 32


class AccessDenied(OrbitKVError):
    """The caller may not do this (see docs/security.md)."""


class Unauthenticated(AccessDenied):
    """An engine call that does not carry that engine's credential (the one its registration answered)."""


class AdminRequired(AccessDenied):
    """An act beyond the calling engine's own namespace (invalidating keys, another namespace, everything):
    it needs the admin token."""


class HandleInUse(OrbitKVError):
    """A registration names memory (a pages file, under any name, or a GPU allocation) that a registered
    engine holds. ``field`` names the handle."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------------------------- callers


class Caller:
    """Who a data-plane call comes from. ``credential`` is what the call carried (empty: none); the OS
    user is asked of ``uid_of`` at most once, and only when a check needs it."""

    __slots__ = ("credential", "_uid_of", "_uid", "_asked", "unknown_because")

    def __init__(self, credential: str = "", uid_of: Callable[[], int | None] | None = None) -> None:
        self.credential = credential
        self._uid_of = uid_of
        self._uid: int | None = None
        self._asked = False
        #: why :meth:`uid` is None when the lookup itself failed (out of descriptors, ``/proc`` not readable),
        #: so that a refusal names the Manager's trouble rather than blaming the caller
        self.unknown_because: str | None = None

    def uid(self) -> int | None:
        """The calling OS user, or None when it cannot be told (a remote TCP peer, no ``/proc``, a failed
        lookup: :attr:`unknown_because`)."""
        if not self._asked:
            self._asked = True
            try:
                self._uid = self._uid_of() if self._uid_of is not None else None
            except OSError as e:
                self.unknown_because = f"the Manager could not look it up: {e}"
        return self._uid


def in_process_caller(credential: str) -> Caller:
    """The Caller of an embedded client: its own credential, this process's user."""
    return Caller(credential, os.getuid)


def issue_credential() -> str:
    """A new engine credential: 32 random bytes, hex."""
    return secrets.token_hex(_CREDENTIAL_BYTES)


def authorize(engine_id: str, secret: bytes, owner_uid: int | None, lookup_by_user: bool,
              caller: Caller | None, *, lookup: bool = False) -> None:
    """The check of one engine call. Passes for a trusted in-process call (``caller`` None), for a call
    carrying the engine's credential, and -- for a lease-free ``lookup`` of an engine registered with
    ``lookup_by_user`` -- for a call from the OS user who registered it. Raises :class:`Unauthenticated`."""
    if caller is None:
        return
    if hmac.compare_digest(secret, caller.credential.encode()):
        return
    if lookup and lookup_by_user and owner_uid is not None and caller.uid() == owner_uid:
        return
    raise Unauthenticated(f"engine {engine_id!r}: the call does not carry the credential its registration "
                          "answered" + (" (none given)" if not caller.credential else ""))


class InsecureBind(OrbitKVError, ValueError):
    """A non-loopback bind address without a token (HTTP plane, peer port), or a token too weak to use."""


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


# ---------------------------------------------------------------------------------------------- registration


def open_pages_file(path: str, shm_dir: str | None, owner_uid: int | None, field: str) -> int:
    """A read-write descriptor of the pages file ``path`` names, once it is known to be a regular file
    directly inside ``shm_dir`` (after resolving symlinks; None: anywhere, for a trusted in-process caller)
    and, when ``owner_uid`` is given and not root, owned by that user. Raises :class:`GeometryError`
    naming ``field``."""
    base = os.path.realpath(shm_dir) if shm_dir is not None else None
    real = os.path.realpath(path)
    if base is not None and os.path.dirname(real) != base:
        raise GeometryError(field, f"{path!r} is not a file directly inside the Manager's shared-memory "
                                   f"directory {base!r}")
    try:
        st = os.lstat(real)
    except OSError as e:
        raise GeometryError(field, f"cannot open engine pages file {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # checked before open: opening a FIFO or a device has effects
        raise GeometryError(field, f"{path!r} is not a regular file")
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise GeometryError(field, f"cannot open engine pages file {path!r}: {e.strerror}") from None
    try:
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(st2.st_mode):
            raise GeometryError(field, f"{path!r} changed while it was opened")
        if owner_uid not in (None, 0) and st2.st_uid != owner_uid:
            # The Manager's user may open files the registrant cannot: it maps only the registrant's own.
            raise GeometryError(field, f"{path!r} belongs to user {st2.st_uid}, not to the registering user "
                                       f"{owner_uid}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_identity(fd: int) -> tuple:
    st = os.fstat(fd)
    return ("file", st.st_dev, st.st_ino)


class HandleClaims:
    """Memory held by registered engines: byte ranges ``[lo, hi)`` of a memory identity (a pages file is
    claimed whole; a CUDA IPC handle names a whole ``cudaMalloc`` block, in which a caching allocator puts
    many tensors, so it is claimed by the extents of the tensors registered in it). Not thread-safe: the
    Manager calls it under its lock."""

    def __init__(self) -> None:
        self._ranges: dict[tuple, list[tuple[int, int, str]]] = {}
        self._held: dict[str, set[tuple]] = {}

    def claim(self, engine_id: str, handles: Iterable[tuple[str, tuple, int, int]]) -> None:
        """Record ``(field, identity, lo, hi)`` claims for ``engine_id``; raises :class:`HandleInUse`
        (recording nothing) when one overlaps memory another engine holds."""
        handles = list(handles)
        for field, ident, lo, hi in handles:
            for olo, ohi, owner in self._ranges.get(ident, ()):
                if owner != engine_id and lo < ohi and olo < hi:
                    raise HandleInUse(field, f"{field} names memory engine {owner!r} registered")
        for _, ident, lo, hi in handles:
            self._ranges.setdefault(ident, []).append((lo, hi, engine_id))
        self._held.setdefault(engine_id, set()).update(ident for _, ident, _, _ in handles)

    def release(self, engine_id: str) -> None:
        for ident in self._held.pop(engine_id, ()):
            left = [r for r in self._ranges.get(ident, ()) if r[2] != engine_id]
            if left:
                self._ranges[ident] = left
            else:
                self._ranges.pop(ident, None)


# ---------------------------------------------------------------------------------------------- peer users

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: a user lookup that failed on the Manager's side: out of descriptors (its own or the system's), no access
_LOOKUP_FAILED = (errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM, errno.ENOMEM)


def socket_uid(sock: socket.socket) -> int | None:
    """The OS user at the other end of a connected socket: ``SO_PEERCRED`` of a Unix socket; for TCP the
    owner of the peer's socket as ``/proc/net/tcp[6]`` lists it (a loopback peer only: a remote host's
    users are not this host's). None when it cannot be told; raises OSError when the lookup failed for want
    of descriptors or access (not the caller's doing)."""
    try:
        if sock.family == socket.AF_UNIX:
            return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            return tcp_peer_uid(sock.getsockname()[:2], sock.getpeername()[:2])
    except OSError as e:
        if e.errno in _LOOKUP_FAILED:
            raise
        return None  # the peer is gone (ENOTCONN)
    return None


def tcp_peer_uid(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """Owner of the loopback TCP socket bound to ``remote`` and connected to ``local`` (this end). Raises
    OSError when a table cannot be read for want of descriptors or access (a missing table, as ``tcp6``
    without IPv6, is skipped)."""
    try:
        if not ipaddress.ip_address(remote[0]).is_loopback and not _mapped_loopback(remote[0]):
            return None
    except ValueError:
        return None
    pairs = {(a, b) for a in _proc_addr(remote) for b in _proc_addr(local)}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb") as f:
                next(f, None)  # the column titles
                for line in f:
                    cols = line.split()
                    if len(cols) > 7 and (cols[1].decode(), cols[2].decode()) in pairs:
                        return int(cols[7])
        except FileNotFoundError:
            continue
    return None


def _mapped_loopback(host: str) -> bool:
    try:
        a = ipaddress.ip_address(host)
    except ValueError:
        return False
    return isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback


def _proc_addr(addr: tuple[str, int]) -> tuple[str, ...]:
    """The spellings ``/proc/net/tcp`` (IPv4) and ``/proc/net/tcp6`` give ``addr``: the address as the
    kernel's 32-bit words in host byte order, then the port."""
    a = ipaddress.ip_address(addr[0])
    port = f"{addr[1]:04X}"
    out = []
    v4 = a if isinstance(a, ipaddress.IPv4Address) else a.ipv4_mapped
    if v4 is not None:
        out.append(f"{int.from_bytes(v4.packed, sys.byteorder):08X}:{port}")
        a = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + v4.packed)
    raw = a.packed
    out.append("".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}" for i in range(0, 16, 4)) + ":" + port)
    return tuple(out)
