"""The peer control protocol: small typed request/response messages between Managers.

Managers talk over a ZeroMQ socket (the requester's DEALER to the peer's ROUTER, at the peer's
``--peer-port``); every frame is one msgpack-encoded :data:`Request` or :data:`Reply`, a tagged
msgspec union. Bytes never travel here: the reply names arena extents and the requester reads them
with the Transfer Engine. Messages:

* :class:`LeaseRequest` -> :class:`LeaseReply` (extents under a lease, the peer's Transfer Engine
  session id and arena base address) or :class:`Refused`.
* :class:`ReleaseRequest` -> :class:`Ack`: drop a lease (the peer also expires it after its TTL).
* :class:`PrefixRequest` -> :class:`PrefixReply`: how many leading chunks the peer holds in full.

Authentication: with a shared peer secret (``--peer-secret-file``, ``$ORBITKV_PEER_SECRET``) every frame
ends in an HMAC-SHA256 of its body under the secret, labelled request or reply (:func:`seal`,
:func:`unseal`): a process without the secret can neither ask this Manager for leases nor answer its
requests, and a reply cannot be passed off as a request. Frames themselves are bounded
(:data:`MAX_FRAME_BYTES`, enforced by the sockets before a byte is buffered).

Invariants: :func:`decode_request` / :func:`decode_reply` / :func:`unseal` raise only
:class:`ProtocolError` for any input; every size is bounded (keys per request, key and namespace lengths)
before use.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Union

import msgspec

from ..errors import OrbitKVError
from ..keys import PACKED_SIZE

__all__ = [
    "Ack", "Extent", "LeaseReply", "LeaseRequest", "MAX_KEYS", "PrefixReply", "PrefixRequest",
    "ProtocolError", "Refused", "RefuseReason", "ReleaseRequest", "Reply", "Request",
    "decode_reply", "decode_request", "encode", "seal", "unseal",
]

#: Keys (or chunks) one request may name.
MAX_KEYS = 16384
PROTOCOL_VERSION = 1
#: Largest control frame either side accepts (ZMQ_MAXMSGSIZE): 16384 packed keys are about 640 KB.
MAX_FRAME_BYTES = 2 << 20
REQUEST, REPLY = b"orbitkv-peer-request-v1\0", b"orbitkv-peer-reply-v1\0"
_TAG = 32
# A frame's lists are bounded from their headers, before any item is built (a 2 MiB frame of empty items would
# otherwise build up to a million objects); the checks after the decode still apply.
_Keys = msgspec.Meta(max_length=MAX_KEYS)


class ProtocolError(OrbitKVError):
    """A peer message that does not decode or breaks the protocol's bounds."""


class RefuseReason:
    NAMESPACE = "namespace"  # the peer does not serve this namespace (or keys name another one)
    BAD_REQUEST = "bad_request"
    BUSY = "busy"  # too many leases outstanding
    VERSION = "version"
    UNAUTHENTICATED = "unauthenticated"  # no valid tag under the peer secret (never answered)


class LeaseRequest(msgspec.Struct, tag="lease", frozen=True):
    req_id: int
    namespace: bytes
    #: Packed :class:`~orbitkv_fs.keys.ObjectKey` s, all of ``namespace``.
    keys: Annotated[list[bytes], _Keys]
    #: The requester's Transfer Engine session id (for the peer's logs and lease accounting).
    requester: str = ""
    version: int = PROTOCOL_VERSION


class ReleaseRequest(msgspec.Struct, tag="release", frozen=True):
    req_id: int
    lease_id: int


class PrefixRequest(msgspec.Struct, tag="prefix", frozen=True):
    req_id: int
    namespace: bytes
    chunks: Annotated[list[bytes], _Keys]
    #: ``(layer, role)`` pairs a chunk needs in full.
    layers: Annotated[list[tuple[int, int]], msgspec.Meta(max_length=4 * MAX_KEYS)]
    version: int = PROTOCOL_VERSION


class Extent(msgspec.Struct, frozen=True, array_like=True):
    """Bytes ``[offset, offset+length)`` of the peer's arena (address ``base_address + offset``)."""

    offset: int
    length: int
    generation: int


class LeaseReply(msgspec.Struct, tag="leased", frozen=True):
    req_id: int
    namespace: bytes
    session_id: str
    base_address: int
    lease_id: int
    #: One per requested key, None where the peer does not hold it in DRAM.
    extents: Annotated[list[Extent | None], _Keys]


class PrefixReply(msgspec.Struct, tag="prefix_count", frozen=True):
    req_id: int
    namespace: bytes
    count: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    req_id: int


class Refused(msgspec.Struct, tag="refused", frozen=True):
    req_id: int
    reason: str
    detail: str = ""


Request = Union[LeaseRequest, ReleaseRequest, PrefixRequest]
Reply = Union[LeaseReply, PrefixReply, Ack, Refused]

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


def encode(msg: "Request | Reply") -> bytes:
    return _enc.encode(msg)


def seal(body: bytes, secret: bytes | None, label: bytes) -> bytes:
    """``body`` as it goes on the wire: followed by its tag under ``secret`` when there is one."""
    if not secret:
        return body
    return body + hmac.new(secret, label + body, hashlib.sha256).digest()


def unseal(frame: bytes, secret: bytes | None, label: bytes) -> bytes:
    """The body of a frame whose tag verifies under ``secret`` (``frame`` itself without a secret). Raises
    :class:`ProtocolError`."""
    if not secret:
        return frame
    body, tag = frame[:-_TAG], frame[-_TAG:]
    if len(frame) < _TAG or not hmac.compare_digest(tag, hmac.new(secret, label + body, hashlib.sha256).digest()):
        raise ProtocolError("a frame without a valid tag under the peer secret")
    return body


def _check_namespace(ns: bytes) -> None:
    if len(ns) != 16:
        raise ProtocolError(f"namespace of {len(ns)} bytes (expected 16)")


def decode_request(frame: bytes) -> Request:
    try:
        msg = _req_dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable peer request: {e}") from None
    if isinstance(msg, LeaseRequest):
        _check_namespace(msg.namespace)
        if len(msg.keys) > MAX_KEYS:
            raise ProtocolError(f"{len(msg.keys)} keys in one request (max {MAX_KEYS})")
        if any(len(k) != PACKED_SIZE for k in msg.keys):
            raise ProtocolError(f"a key is not {PACKED_SIZE} bytes")
    elif isinstance(msg, PrefixRequest):
        _check_namespace(msg.namespace)
        if len(msg.chunks) > MAX_KEYS or len(msg.chunks) * max(len(msg.layers), 1) > 4 * MAX_KEYS:
            raise ProtocolError("prefix request too large")
        if any(len(c) != 16 for c in msg.chunks):
            raise ProtocolError("a chunk key is not 16 bytes")
    return msg


def decode_reply(frame: bytes) -> Reply:
    try:
        return _rep_dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable peer reply: {e}") from None
