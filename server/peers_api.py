"""HTTP routes of peer sharing: ``GET/POST /v1/peers``, ``GET/DELETE /v1/peers/{peer_id}``,
``GET /v1/peers/stats``.

Owns only the HTTP mapping; the registry and counters are :class:`orbitkv_fs.peers.PeerClient`'s. The app
includes :data:`router` and sets ``app.state.peer_node`` to the process's
:class:`~orbitkv_fs.peers.PeerNode` (or None: then every route answers 503, peer sharing is off). A peer id
is its ``host:port`` peer address. Invariants: a bad address is a 422 and nothing is registered; a
duplicate is a 409; an unknown id a 404; no route raises past FastAPI.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from orbitkv_fs.peers import PeerError, PeerNode, UnknownPeer

__all__ = ["router"]

router = APIRouter(prefix="/v1/peers", tags=["peers"])


class PeerAdd(BaseModel):
    address: str = Field(..., description="the peer Manager's peer port, host:port", examples=["10.0.0.2:9300"],
                         min_length=3, max_length=300)


class PeerOut(BaseModel):
    id: str
    address: str
    session_id: str
    state: str
    consecutive_failures: int
    backoff_remaining_s: float
    requests_total: int
    keys_fetched_total: int
    fetched_bytes_total: int
    failures_total: dict[str, int]
    static: bool


class PeerList(BaseModel):
    address: str = Field(..., description="this Manager's peer address (what other Managers register)")
    session_id: str = Field(..., description="this Manager's Transfer Engine session id")
    peers: list[PeerOut]


def _node(request: Request) -> PeerNode:
    node = getattr(request.app.state, "peer_node", None)
    if node is None:
        raise HTTPException(503, "peer sharing is off (start with --peer or --peer-port)")
    return node


def _out(info: Any) -> PeerOut:
    return PeerOut(**msgspec.to_builtins(info))


@router.get("", response_model=PeerList, responses={503: {"description": "peer sharing is off"}})
def list_peers(request: Request) -> PeerList:
    node = _node(request)
    return PeerList(address=node.address, session_id=node.transport.session_id,
                    peers=[_out(p) for p in node.client.peers()])


@router.post("", response_model=PeerOut, status_code=201,
             responses={409: {"description": "already registered"}, 422: {"description": "bad address"},
                        503: {"description": "peer sharing is off"}})
def add_peer(body: PeerAdd, request: Request) -> PeerOut:
    node = _node(request)
    try:
        return _out(node.client.add_peer(body.address.strip()))
    except PeerError as e:
        raise HTTPException(409 if "already" in str(e) else 422, str(e)) from None


@router.get("/stats", responses={503: {"description": "peer sharing is off"}})
def peer_stats(request: Request) -> dict:
    """The peer layer's counters (:class:`orbitkv_fs.peers.PeerStats`)."""
    return msgspec.to_builtins(_node(request).stats())


@router.get("/{peer_id}", response_model=PeerOut,
            responses={404: {"description": "unknown peer"}, 503: {"description": "peer sharing is off"}})
def get_peer(peer_id: str, request: Request) -> PeerOut:
    try:
        return _out(_node(request).client.get_peer(peer_id))
    except UnknownPeer:
        raise HTTPException(404, f"no peer {peer_id!r}") from None


@router.delete("/{peer_id}", status_code=204,
               responses={404: {"description": "unknown peer"}, 503: {"description": "peer sharing is off"}})
def remove_peer(peer_id: str, request: Request) -> Response:
    try:
        _node(request).client.remove_peer(peer_id)
    except UnknownPeer:
        raise HTTPException(404, f"no peer {peer_id!r}") from None
    return Response(status_code=204)
