"""``/v1/peers`` routes (server/peers_api.py) on a real uvicorn on loopback over a real PeerNode, and the
``--peer*`` flags of orbitkv-cache-manager."""

from __future__ import annotations


import httpx
import pytest

from orbitkv_fs.peers import PeerNode, transport_available
from orbitkv_fs.peers.client import PeerConfig
from orbitkv_fs.tools.bench_peer import ShmArena

pytestmark = pytest.mark.skipif(not transport_available(), reason="mooncake Transfer Engine not importable")


@pytest.fixture
def api():
    from fastapi import FastAPI

    from orbitkv_fs.server.app import HttpServer
    from orbitkv_fs.server.peers_api import router

    arena = ShmArena(1 << 20, [bytes(16)])
    node = PeerNode(arena, peers=["127.0.0.1:1"])
    app = FastAPI()
    app.include_router(router)
    app.state.peer_node = node
    # HttpServer, not a bare uvicorn.Config: uvicorn's default log config would rewire the process's
    # logging for every later test.
    server = HttpServer(app, "127.0.0.1", 0)
    server.start()
    with httpx.Client(base_url=server.url, timeout=5) as client:
        yield client, app, node
    server.close()
    node.close()
    arena.close()


def test_peer_routes(api):
    client, app, node = api
    r = client.get("/v1/peers")
    assert r.status_code == 200
    body = r.json()
    assert body["address"] == node.address and body["session_id"] == node.transport.session_id
    assert [p["id"] for p in body["peers"]] == ["127.0.0.1:1"] and body["peers"][0]["static"] is True

    r = client.post("/v1/peers", json={"address": "127.0.0.1:9400"})
    assert r.status_code == 201 and r.json()["static"] is False and r.json()["state"] == "ok"
    assert client.post("/v1/peers", json={"address": "127.0.0.1:9400"}).status_code == 409
    assert client.post("/v1/peers", json={"address": "nonsense"}).status_code == 422
    assert client.post("/v1/peers", json={"address": "127.0.0.1:99999"}).status_code == 422
    assert client.post("/v1/peers", json={}).status_code == 422
    assert client.get("/v1/peers/127.0.0.1:9400").json()["address"] == "127.0.0.1:9400"
    assert client.get("/v1/peers/127.0.0.1:9401").status_code == 404

    stats = client.get("/v1/peers/stats").json()
    assert stats["session_id"] == node.transport.session_id and len(stats["peers"]) == 2

    assert client.delete("/v1/peers/127.0.0.1:9400").status_code == 204
    assert client.delete("/v1/peers/127.0.0.1:9400").status_code == 404
    assert [p["id"] for p in client.get("/v1/peers").json()["peers"]] == ["127.0.0.1:1"]

    app.state.peer_node = None
    assert client.get("/v1/peers").status_code == 503
    assert client.post("/v1/peers", json={"address": "127.0.0.1:9400"}).status_code == 503
    app.state.peer_node = node


def test_cli_flags():
    from orbitkv_fs.server.cli import build_parser

    args = build_parser().parse_args(["--peer", "10.0.0.2:9300", "--peer", "10.0.0.3:9300", "--peer-port", "9300",
                                      "--peer-budget-ms", "250"])
    assert args.peer == ["10.0.0.2:9300", "10.0.0.3:9300"] and args.peer_port == 9300
    assert args.peer_budget_ms == 250.0
    args = build_parser().parse_args([])
    from orbitkv_fs.peers.node import start_from_args

    assert start_from_args(object(), args) is None  # peer sharing off unless asked for


def test_peer_routes_and_metrics_in_the_control_plane(tmp_path):
    """The shipped app (server/app.py) with a real Manager and PeerNode: mutations need the admin token,
    reads do not; a peer fetch shows up in /metrics and /v1/peers/stats."""
    from orbitkv_fs.manager import Manager, ManagerConfig
    from orbitkv_fs.server.app import HttpServer, create_app
    from orbitkv_fs.server.auth import AdminToken
    from orbitkv_fs.tools.bench_peer import make_segments, start_server, stop_server

    ns = bytes(range(16))
    proc, a = start_server(ns, ["2:65536:21"])
    m = Manager(ManagerConfig(pool_size=16 << 20, device="cpu"))
    # A generous budget: the first fetch also connects to the peer, slow on a loaded 2-core CI host.
    node = PeerNode(m, config=PeerConfig(budget_s=10.0))
    http = HttpServer(create_app(m, admin_token=AdminToken("sekret-0123456789abcdef"), address="127.0.0.1:0", peer_node=node),
                      "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=http.url, timeout=10) as c:
            assert c.get("/v1/peers").json()["peers"] == []
            assert c.post("/v1/peers", json={"address": a["address"]}).status_code == 401
            r = c.post("/v1/peers", json={"address": a["address"]}, headers={"Authorization": "Bearer sekret-0123456789abcdef"})
            assert r.status_code == 201, r.text
            keys = [k for k, _ in make_segments(ns, 2, 65536, 21)]
            assert sorted(node.client.fetch_into(m, keys), key=keys.index) == keys
            stats = c.get("/v1/peers/stats").json()
            assert stats["keys_fetched_total"] == 2 and stats["peers"][0]["session_id"] == a["session_id"]
            metrics = c.get("/metrics").text
            assert "orbitkv_peer_keys_fetched_total 2.0" in metrics
            assert "orbitkv_peer_hit_latency_seconds_count 1.0" in metrics
            assert c.delete(f"/v1/peers/{a['address']}").status_code == 401
            assert c.delete(f"/v1/peers/{a['address']}",
                            headers={"Authorization": "Bearer sekret-0123456789abcdef"}).status_code == 204
    finally:
        http.close()
        node.close()
        m.close()
        stop_server(proc)
