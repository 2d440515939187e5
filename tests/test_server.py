"""The HTTP control plane on a real uvicorn on loopback, driven with httpx, over a real Manager with a real
SSD tier (io_uring on tmp files) and host engine pages in /dev/shm. The data path runs through the
Manager's client API (:func:`orbitkv_fs.client.connect`), as an engine's connector would."""

from __future__ import annotations

import logging
import os
import threading
import time

import ml_dtypes
import msgspec
import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from orbitkv_fs.client import connect  # noqa: E402
from orbitkv_fs.keys import chunk_key  # noqa: E402
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig, UnknownEngine  # noqa: E402
from orbitkv_fs.pages import host_engine_pages  # noqa: E402
from orbitkv_fs.server.app import HttpServer, create_app  # noqa: E402
from orbitkv_fs.server.auth import AdminToken, InsecureBind  # noqa: E402
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier  # noqa: E402

from metrics_text import m1, metrics  # noqa: E402

L, B, T, H, D = 4, 64, 16, 2, 64
TOKEN = "s3cr3t-admin-token-for-tests-0123"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


# ---------------------------------------------------------------------------------------------- fixtures


class Stack:
    def __init__(self, tmp_path, *, token: str | None = None, pool: int = 4 << 20, access_log: bool = False) -> None:
        self.ssd = SsdTier(SsdConfig(paths=(str(tmp_path / "ssd0"),), capacity=32 << 20))
        self.manager = Manager(ManagerConfig(pool_size=pool, shm_dir=SHM, device="cpu"), lower_tier=self.ssd)
        self.app = create_app(self.manager, admin_token=AdminToken(token) if token else None,
                              address="127.0.0.1:0")
        self.server = HttpServer(self.app, "127.0.0.1", 0, access_log=access_log,
                                 log_level="debug" if access_log else "warning").start()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.server.url, timeout=30, headers=headers)
        self.anon = httpx.Client(base_url=self.server.url, timeout=30)
        self.client = connect(self.manager)
        self.pages: list = []

    def engine_pages(self, layout: str = "separate", seed: int = 7):
        pages, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D,
                                         layout=layout, directory=SHM)
        rng = np.random.default_rng(seed)
        for name in pages.tensors:
            a = pages.array(name)
            a[...] = (rng.standard_normal(a.shape) * 2).astype(ml_dtypes.bfloat16)
        self.pages.append(pages)
        return pages, descs

    def close(self) -> None:
        self.http.close()
        self.anon.close()
        self.server.close()
        self.manager.close()
        for p in self.pages:
            p.close()


def reg_body(descs, **kw) -> dict:
    """The REST registration of host-pages descriptors: handles by shared-memory object name."""
    tensors = [{"layer": d.layer, "role": d.role, "layout": d.layout, "shape": list(d.shape),
                "strides": list(d.strides), "dtype": d.dtype, "name": d.name,
                "handle": {"type": "host", "name": os.path.basename(d.handle.path), "offset": d.handle.offset}}
               for d in descs]
    body = {"model": "test-model", "num_layers": L, "layer_start": 0, "layer_end": L, "block_size": T,
            "num_heads": H, "head_dim": D, "dtype": "bfloat16", "tensors": tensors}
    body.update(kw)
    return body


def chunks(n: int, salt: str = "c", per: int = 2, base: int = 0) -> list[ChunkBlocks]:
    return [ChunkBlocks(chunk_key(f"{salt}{i}"), list(range(base + per * i, base + per * (i + 1)))) for i in range(n)]


def assert_error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code and isinstance(body["message"], str) and body["message"], body
    assert set(body) <= {"code", "message", "field"}
    return body


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    yield s
    s.close()


@pytest.fixture
def secured(tmp_path):
    s = Stack(tmp_path, token=TOKEN, access_log=True)
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------- endpoints


def test_health_ready_config_docs(stack):
    assert stack.http.get("/healthz").json() == {"status": "ok"}
    assert stack.http.get("/readyz").json() == {"status": "ready", "engines": 0, "lower_tier": "ssd",
                                                "lower_tier_missing": None, "peers": False}
    cfg = stack.http.get("/v1/config").json()
    assert cfg["manager"]["pool_size"] == 4 << 20 and cfg["lower_tier"] == "ssd"
    assert cfg["http"] == {"address": "127.0.0.1:0", "auth_required": False, "max_body_bytes": 4 << 20,
                           "max_connections": 256, "request_timeout_s": 30.0}
    assert "swagger" in stack.http.get("/docs").text.lower()
    paths = stack.http.get("/openapi.json").json()["paths"]
    for p in ("/v1/engines", "/v1/engines/{engine_id}", "/v1/invalidate", "/metrics", "/v1/stats", "/healthz",
              "/readyz", "/v1/config", "/v1/admin/flush-dram", "/v1/objects"):
        assert p in paths, p
    assert_error(stack.http.get("/nope"), 404, "not_found")
    assert_error(stack.http.put("/v1/engines"), 405, "method_not_allowed")
    stack.app.state.ready = False
    assert_error(stack.http.get("/readyz"), 503, "not_ready")
    assert_error(stack.http.get("/v1/peers"), 404, "peers_off")
    assert_error(stack.http.post("/v1/peers", json={}), 404, "peers_off")
    assert "securitySchemes" not in stack.http.get("/openapi.json").json().get("components", {})


def test_unexpected_failure_is_a_json_500(stack, monkeypatch):
    def broken():  # fault injection: a Manager bug surfaces as 500 {code, message}, not a dropped connection
        raise RuntimeError("boom: internal detail")

    monkeypatch.setattr(stack.manager, "stats", broken)
    body = assert_error(stack.http.get("/v1/stats"), 500, "internal")
    assert "boom" not in body["message"]
    assert stack.http.get("/healthz").status_code == 200


def test_register_list_get_delete(stack):
    _, descs = stack.engine_pages()
    r = stack.http.post("/v1/engines", json=reg_body(descs, engine_id="vllm-0", codec="fp8"))
    assert r.status_code == 201, r.text
    e = r.json()
    credential = e.pop("credential")  # the registration's answer alone carries it
    assert len(credential) == 64 and credential not in stack.http.get("/v1/engines").text
    assert r.headers["location"] == "/v1/engines/vllm-0"
    assert e["engine_id"] == "vllm-0" and len(e["namespace"]) == 32 and e["codec"] == "fp8"
    assert (e["num_blocks"], e["tensors"], e["segments_per_chunk"], e["device"]) == (B, 2 * L, 2 * L, "host")
    assert "handle" not in r.text and SHM not in r.text  # handles are not echoed
    # Nobody registers over an engine's pages, whatever id they ask for, nor through another name for them.
    body = assert_error(stack.http.post("/v1/engines", json=reg_body(descs)), 409, "handle_in_use")
    assert body["field"] == "tensors[0].handle" and "vllm-0" in body["message"]
    link = os.path.join(SHM, f"orbitkv-test-hardlink-{os.getpid()}")
    os.link(descs[0].handle.path, link)
    try:
        linked = reg_body(descs)
        for t in linked["tensors"]:
            t["handle"]["name"] = os.path.basename(link)
        body = assert_error(stack.http.post("/v1/engines", json=linked), 409, "handle_in_use")
        assert "vllm-0" in body["message"]
    finally:
        os.unlink(link)
    _, descs2 = stack.engine_pages(seed=8)
    r2 = stack.http.post("/v1/engines", json=reg_body(descs2))
    assert r2.status_code == 201
    other = r2.json()["engine_id"]
    assert other.startswith("generic-") and r2.json()["namespace"] != e["namespace"]  # codec is in the namespace
    assert [x["engine_id"] for x in stack.http.get("/v1/engines").json()["engines"]] == ["vllm-0", other]
    assert stack.http.get("/v1/engines/vllm-0").json() == e
    assert stack.manager.get_engine("vllm-0").engine_id == "vllm-0"
    assert_error(stack.http.post("/v1/engines", json=reg_body(descs, engine_id="vllm-0")), 409, "engine_busy")
    r = stack.http.delete("/v1/engines/vllm-0")
    assert r.status_code == 204 and r.content == b""
    assert_error(stack.http.get("/v1/engines/vllm-0"), 404, "unknown_engine")
    assert_error(stack.http.delete("/v1/engines/vllm-0"), 404, "unknown_engine")
    assert_error(stack.http.get("/v1/engines/bad%01id"), 422, "invalid_request")
    assert_error(stack.http.get("/v1/engines/" + "a" * 129), 422, "invalid_request")
    assert_error(stack.http.get("/v1/engines/any printable id"), 404, "unknown_engine")
    with pytest.raises(UnknownEngine):
        stack.client.save("vllm-0", chunks(1))
    assert stack.http.delete(f"/v1/engines/{other}").status_code == 204
    assert stack.http.get("/v1/engines").json() == {"engines": []}
    assert stack.http.post("/v1/engines", json=reg_body(descs)).status_code == 201  # free again


def test_registration_errors(stack, tmp_path):
    pages, descs = stack.engine_pages()
    name = os.path.basename(pages.path)
    good = reg_body(descs)

    def post(body):
        return stack.http.post("/v1/engines", json=body)

    # A path is refused, whatever it points at.
    bad = reg_body(descs)
    bad["tensors"][0]["handle"] = {"type": "host", "path": pages.path, "offset": 4096}
    body = assert_error(post(bad), 422, "invalid_request")
    assert "not a file-system path" in body["message"]
    for evil in ("../etc/passwd", "/etc/passwd", "a/b", ".hidden", "..", ""):
        bad = reg_body(descs)
        bad["tensors"][0]["handle"]["name"] = evil
        assert_error(post(bad), 422, "invalid_request")
    # Names that resolve to no regular file in the shm directory.
    link = os.path.join(SHM, f"orbitkv-test-link-{os.getpid()}")
    fifo = os.path.join(SHM, f"orbitkv-test-fifo-{os.getpid()}")
    os.symlink(pages.path, link)
    os.mkfifo(fifo)
    try:
        for target, why in ((link, "not a regular file"), (fifo, "not a regular file"),
                            (os.path.join(SHM, "orbitkv-no-such-object"), "no shared-memory object")):
            bad = reg_body(descs)
            bad["tensors"][1]["handle"]["name"] = os.path.basename(target)
            body = assert_error(post(bad), 422, "invalid_registration")
            assert body["field"] == "tensors[1].handle.name" and why in body["message"]
    finally:
        os.unlink(link)
        os.unlink(fifo)
    # The Manager's checks against the mapped tensor name the field.
    bad = reg_body(descs)
    bad["tensors"][0]["shape"][2] = H + 1
    body = assert_error(post(bad), 422, "invalid_registration")
    assert body["field"].startswith("tensors[0]")
    bad = reg_body(descs)
    bad["tensors"][0]["handle"]["offset"] = 12345
    assert assert_error(post(bad), 422, "invalid_registration")["field"] == "tensors[0].handle.offset"
    bad = reg_body(descs, layer_end=L + 1)
    assert_error(post(bad), 422, "invalid_registration")
    cuda = reg_body(descs)
    for t in cuda["tensors"]:
        t["handle"] = {"type": "cuda_ipc", "handle": "A" * 86 + "==", "offset": 0}
    assert "no GPU" in assert_error(post(cuda), 422, "invalid_registration")["message"]
    cuda["tensors"][0]["handle"]["handle"] = "not base64!"
    assert_error(post(cuda), 422, "invalid_request")
    # Strict models: unknown fields, coerced types, bounded lists and strings.
    assert_error(post({**good, "surprise": 1}), 422, "invalid_request")
    assert_error(post({**good, "block_size": "16"}), 422, "invalid_request")
    assert_error(post({**good, "block_size": 16.0}), 422, "invalid_request")
    assert_error(post({**good, "tensors": []}), 422, "invalid_request")
    assert_error(post({**good, "model": "m" * 257}), 422, "invalid_request")
    assert_error(post({**good, "codec": "zip"}), 422, "invalid_request")
    assert_error(post({**good, "engine_id": "has space"}), 422, "invalid_request")
    t0 = dict(good["tensors"][0], handle={"type": "host", "name": name, "offset": 4096, "extra": 1})
    assert_error(post({**good, "tensors": [t0]}), 422, "invalid_request")
    assert_error(stack.http.post("/v1/engines", content=b"{not json", headers={"content-type": "application/json"}),
                 422, "invalid_request")
    assert_error(stack.http.post("/v1/engines", content=b"\xca\xaa\xff", headers={"content-type": "application/json"}),
                 400, "bad_request")
    assert stack.manager.list_engines() == []  # nothing half-registered
    assert post(good).status_code == 201


def test_a_registration_over_its_users_quota_is_429_and_counted(stack):
    """The registering OS user's quota of engines (``--max-engines-per-user``) over REST: 429
    ``too_many_engines``, nothing registered, ``orbitkv_registrations_refused_total`` counts it."""
    from orbitkv_fs.server.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--max-engines-per-user", "1", "--max-tensors-per-user", "64"]))
    assert (cfg.max_engines_per_user, cfg.max_tensors_per_user) == (1, 64)
    stack.manager._config = msgspec.structs.replace(stack.manager._config, max_engines_per_user=1)
    _, descs = stack.engine_pages()
    assert stack.http.post("/v1/engines", json=reg_body(descs)).status_code == 201
    _, other = stack.engine_pages()
    body = assert_error(stack.http.post("/v1/engines", json=reg_body(other)), 429, "too_many_engines")
    assert "--max-engines-per-user" in body["message"]
    assert len(stack.http.get("/v1/engines").json()["engines"]) == 1
    assert m1(metrics(stack.http), "orbitkv_registrations_refused_total") == 1


def test_body_limits(stack):
    big = b'{"all": true, "pad": "' + b"x" * (5 << 20) + b'"}'
    body = assert_error(stack.http.post("/v1/invalidate", content=big, headers={"content-type": "application/json"}),
                        413, "payload_too_large")
    assert "4194304" in body["message"]

    def stream():  # no Content-Length: the limit applies to the bytes as they arrive
        for _ in range(6):
            yield b" " * (1 << 20)

    assert_error(stack.http.post("/v1/invalidate", content=stream(), headers={"content-type": "application/json"}),
                 413, "payload_too_large")
    keys = [f"{'0' * 32}/{'1' * 32}/L0/key"] * 10_001
    assert_error(stack.http.post("/v1/invalidate", json={"keys": keys}), 422, "invalid_request")
    assert stack.http.post("/v1/invalidate", json={"keys": keys[:10_000]}).status_code == 200


def _ids(objs):
    return sorted(o["key"] for o in objs)


def test_invalidate_flush_and_objects(stack):
    _, descs = stack.engine_pages()
    e = stack.http.post("/v1/engines", json=reg_body(descs, engine_id="e1")).json()
    ns = e["namespace"]
    first, second = chunks(4, "a"), chunks(4, "b", base=16)
    assert stack.client.save("e1", first).segments == 4 * 2 * L
    # flush-dram moves everything unleased to the SSD tier and waits for the writeback.
    f = stack.http.post("/v1/admin/flush-dram").json()
    assert f["submitted"]["objects"] == 4 * 2 * L and f["dropped"] == {"objects": 0, "bytes": 0}
    assert f["skipped_leased"] == 0
    assert stack.client.save("e1", second).segments == 4 * 2 * L
    # Objects, paginated: DRAM rows then SSD rows, each exactly once.
    seen, cursor, pages_n = [], None, 0
    while True:
        params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
        page = stack.http.get("/v1/objects", params=params).json()
        seen += page["objects"]
        pages_n += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages_n == -(-len(seen) // 7) and len(seen) == 8 * 2 * L == len(set(_ids(seen)))
    for forged in ("dram:zz", "dram:" + "0" * 71, "ssd:00", "dram", "lower:zz", "lower:abc"):  # cursors no page handed out
        assert_error(stack.http.get("/v1/objects", params={"cursor": forged}), 422, "invalid_request")
    tiers = {o["tier"] for o in seen}
    assert tiers == {"dram", "ssd"}
    dram_rows = [o for o in seen if o["tier"] == "dram"]
    assert all(o["format"] == "raw" and o["original_length"] == 2 * T * H * D * 2 for o in dram_rows)
    assert _ids(seen) == _ids(msgspec_objects(stack.manager.list_objects(limit=1000).objects))
    one = first[0].key.hex()
    only = stack.http.get("/v1/objects", params={"prefix": one[:6], "namespace": ns}).json()["objects"]
    assert {o["key"].split("/")[1] for o in only} == {one} and len(only) == 2 * L
    assert stack.http.get("/v1/objects", params={"namespace": "0" * 32}).json() == {"objects": [], "next_cursor": None}
    for bad in ({"limit": 0}, {"limit": 1001}, {"cursor": "ssd:00"}, {"prefix": "xyz"}, {"namespace": "00"}):
        assert_error(stack.http.get("/v1/objects", params=bad), 422, "invalid_request")
    # Invalidate: by keys (one DRAM, one SSD object), by namespace+chunks, by engine, then everything.
    keys = [dram_rows[0]["key"], next(o["key"] for o in seen if o["tier"] == "ssd")]
    r = stack.http.post("/v1/invalidate", json={"keys": keys}).json()
    assert r["tiers"] == {"dram": {"objects": 1, "bytes": dram_rows[0]["stored_length"] + 64},
                          "ssd": {"objects": 1, "bytes": r["tiers"]["ssd"]["bytes"]}}
    assert r["tiers"]["ssd"]["bytes"] > 0 and r["objects"] == 2
    r = stack.http.post("/v1/invalidate", json={"namespace": ns, "chunks": [second[1].key.hex()]}).json()
    assert r["tiers"]["dram"]["objects"] == 2 * L and r["tiers"]["ssd"]["objects"] == 0
    r = stack.http.post("/v1/invalidate", json={"engine_id": "e1", "chunks": [first[1].key.hex()]}).json()
    assert r["tiers"]["dram"]["objects"] == 0 and r["tiers"]["ssd"]["objects"] == 2 * L
    left = stack.manager.stats()
    r = stack.http.post("/v1/invalidate", json={"engine_id": "e1"}).json()
    assert r["tiers"]["dram"]["objects"] == left.resident_objects["dram"] == 3 * 2 * L - 1
    assert r["tiers"]["ssd"]["objects"] == 3 * 2 * L - 1
    assert r["objects"] == r["tiers"]["dram"]["objects"] + r["tiers"]["ssd"]["objects"]
    assert stack.http.get("/v1/objects").json()["objects"] == []
    assert stack.client.lookup("e1", [c.key for c in first + second], lease=False).count == 0
    stack.client.save("e1", first[:1])
    assert stack.http.post("/v1/invalidate", json={"all": True}).json()["tiers"]["dram"]["objects"] == 2 * L
    assert stack.http.post("/v1/invalidate", json={"namespace": ns}).json()["objects"] == 0
    # Errors.
    assert_error(stack.http.post("/v1/invalidate", json={"engine_id": "nope"}), 404, "unknown_engine")
    for bad in ({}, {"all": False}, {"all": True, "namespace": ns}, {"keys": keys, "chunks": [one]},
                {"all": True, "chunks": [one]}, {"keys": ["a/b/L0/key"]}, {"keys": []}, {"namespace": "xyz"},
                {"chunks": [one]}, {"all": "yes"}, {"keys": [f"{ns}/{one}/L65536/key"]}):
        assert_error(stack.http.post("/v1/invalidate", json=bad), 422, "invalid_request")


def msgspec_objects(objs):
    return [{"key": o.key} for o in objs]


# ---------------------------------------------------------------------------------------------- metrics


REQUIRED = [
    "orbitkv_hits_total", "orbitkv_misses_total", "orbitkv_resident_bytes", "orbitkv_resident_objects",
    "orbitkv_evictions_total", "orbitkv_pool_used_bytes", "orbitkv_pool_capacity_bytes",
    "orbitkv_save_logical_bytes_total", "orbitkv_save_stored_bytes_total", "orbitkv_restore_logical_bytes_total",
    "orbitkv_restore_stored_bytes_total", "orbitkv_save_duration_seconds_bucket",
    "orbitkv_restore_duration_seconds_count", "orbitkv_codec_batches_total", "orbitkv_codec_segments_total",
    "orbitkv_encode_duration_seconds_sum", "orbitkv_decode_duration_seconds_count", "orbitkv_raw_segments_total",
    "orbitkv_decode_failures_total", "orbitkv_reserved_bytes", "orbitkv_workspace_bytes",
    "orbitkv_ssd_read_bytes_total", "orbitkv_ssd_write_bytes_total", "orbitkv_ssd_read_latency_p99_seconds",
    "orbitkv_ssd_write_latency_p50_seconds", "orbitkv_ssd_corrupt_records_total", "orbitkv_ssd_backend_info",
    "orbitkv_gpu_codec_workspace_bytes", "orbitkv_gpu_codec_workspace_grows_total", "orbitkv_gpu_codec_batches_total",
    "orbitkv_gpu_codec_segments_total", "orbitkv_gpu_codec_cpu_fallbacks_total", "orbitkv_gpu_codec_wait_seconds_total",
]


def test_metrics_move_with_work(stack):
    names = {k[0] for k in metrics(stack.http)}
    before = metrics(stack.http)
    pages, descs = stack.engine_pages()
    _, descs2 = stack.engine_pages(seed=8)
    assert stack.http.post("/v1/engines", json=reg_body(descs, engine_id="fp", codec="fp8")).status_code == 201
    assert stack.http.post("/v1/engines", json=reg_body(descs2, engine_id="raw")).status_code == 201
    work = chunks(3, "m")
    pages.array("L1.value")[work[2].blocks[0], 0, 0, 0] = 1000.0  # FP8 keeps that segment raw (> 448)
    stack.client.save("fp", work)
    stack.client.save("raw", work)
    lk = stack.client.lookup("fp", [c.key for c in work])
    assert lk.count == 3
    stack.client.restore("fp", work, lease_id=lk.lease_id)
    miss = stack.client.restore("raw", chunks(1, "never-saved", base=40))
    assert miss.restored == [False]
    after = metrics(stack.http)
    names = {k[0] for k in after}
    for n in REQUIRED:
        assert n in names, n
    assert m1(after, "orbitkv_engines") == 2
    assert m1(after, "orbitkv_save_requests_total") - m1(before, "orbitkv_save_requests_total") == 2
    assert m1(after, "orbitkv_save_duration_seconds_count") == 2
    assert m1(after, "orbitkv_save_duration_seconds_bucket", le="+Inf") == 2
    assert m1(after, "orbitkv_restore_duration_seconds_count") == 2
    assert m1(after, "orbitkv_save_logical_bytes_total") == 2 * 3 * 2 * L * 2 * T * H * D * 2
    assert m1(after, "orbitkv_restore_logical_bytes_total") == 3 * 2 * L * 2 * T * H * D * 2
    assert m1(before, "orbitkv_raw_segments_total", reason="out_of_range") == 0
    assert m1(after, "orbitkv_raw_segments_total", reason="out_of_range") == 1
    assert m1(after, "orbitkv_codec_segments_total", representation="fp8") == 3 * 2 * L - 1
    assert m1(after, "orbitkv_codec_segments_total", representation="raw") == 3 * 2 * L + 1
    assert m1(after, "orbitkv_codec_batches_total") >= 1
    assert m1(after, "orbitkv_encode_duration_seconds_count") == m1(after, "orbitkv_codec_batches_total")
    assert m1(after, "orbitkv_decode_duration_seconds_count") > 0
    assert m1(after, "orbitkv_hits_total", tier="dram") == 3 * 2 * L
    assert m1(after, "orbitkv_misses_total", tier="ssd") == 2 * L
    assert m1(after, "orbitkv_misses_total", tier="dram") == 2 * L
    assert m1(after, "orbitkv_resident_bytes", tier="dram", representation="fp8") > 0
    assert m1(after, "orbitkv_resident_bytes", tier="dram", representation="raw") > 0
    assert m1(after, "orbitkv_pool_used_bytes") > 0
    assert (m1(after, "orbitkv_reserved_bytes"), m1(after, "orbitkv_workspace_bytes"),
            m1(after, "orbitkv_leases_active"), m1(after, "orbitkv_pinned_chunks"),
            m1(after, "orbitkv_leased_bytes")) == (0, 0, 0, 0, 0)
    assert m1(after, "orbitkv_ssd_write_bytes_total") == 0
    # Demote to SSD, read back from SSD: SSD counters and lower-tier hits move.
    stack.http.post("/v1/admin/flush-dram")
    res = stack.client.restore("raw", work)
    assert res.restored == [True] * 3
    later = metrics(stack.http)
    assert m1(later, "orbitkv_ssd_write_bytes_total") > 0 and m1(later, "orbitkv_ssd_read_bytes_total") > 0
    assert m1(later, "orbitkv_hits_total", tier="ssd") == 3 * 2 * L
    assert m1(later, "orbitkv_ssd_read_latency_p99_seconds") > 0
    # A corrupted DRAM segment is a decode failure and a miss, never a crash.
    lease, ext = stack.manager.lease_objects([_first_key(stack, "raw", work[0])])
    stack.manager.dram.view(ext[0].offset + ext[0].length - 1, 1)[0] ^= 0xFF  # fault injection
    stack.manager.release(lease)
    assert stack.client.restore("raw", work[:1]).restored == [False]
    final = metrics(stack.http)
    assert m1(final, "orbitkv_decode_failures_total") == m1(later, "orbitkv_decode_failures_total") + 1
    # /v1/stats reports the same facts.
    st = stack.http.get("/v1/stats").json()
    assert st["save_requests"] == m1(final, "orbitkv_save_requests_total")
    assert st["hits"]["lower"] == m1(final, "orbitkv_hits_total", tier="ssd")
    assert st["lower"]["ssd_write_bytes_total"] == m1(final, "orbitkv_ssd_write_bytes_total")
    assert st["durations"]["save"]["count"] == m1(final, "orbitkv_save_duration_seconds_count")
    assert st["peers"] is None


def _first_key(stack, engine_id, chunk):
    from orbitkv_fs.keys import ObjectKey
    from orbitkv_fs.segment import Role

    ns = bytes.fromhex(stack.manager.get_engine(engine_id).namespace)
    return ObjectKey(ns, chunk.key, 0, Role.KEY)


# ---------------------------------------------------------------------------------------------- auth


def test_auth_on(secured, caplog):
    caplog.set_level(logging.DEBUG)
    s = secured
    _, descs = s.engine_pages()
    mutating = [("POST", "/v1/engines", reg_body(descs)), ("DELETE", "/v1/engines/x", None),
                ("POST", "/v1/invalidate", {"all": True}), ("POST", "/v1/admin/flush-dram", None),
                ("GET", "/v1/objects", None)]
    for method, path, body in mutating:
        r = s.anon.request(method, path, json=body)
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        for wrong in (TOKEN[:-1], TOKEN + "x", "x", TOKEN.upper()):
            r = s.anon.request(method, path, json=body, headers={"Authorization": f"Bearer {wrong}"})
            assert_error(r, 401, "unauthorized")
        r = s.anon.request(method, path, json=body, headers={"Authorization": f"Basic {TOKEN}"})
        assert_error(r, 401, "unauthorized")
    # With the token the same calls go through (to their own answers).
    assert s.http.post("/v1/engines", json=reg_body(descs, engine_id="x")).status_code == 201
    assert s.http.delete("/v1/engines/x").status_code == 204
    assert s.http.post("/v1/invalidate", json={"all": True}).status_code == 200
    assert s.http.post("/v1/admin/flush-dram").status_code == 200
    assert s.http.get("/v1/objects").status_code == 200
    # Reads stay open (Prometheus, probes).
    for path in ("/healthz", "/readyz", "/metrics", "/v1/stats", "/v1/config", "/v1/engines", "/openapi.json"):
        assert s.anon.get(path).status_code == 200, path
    schema = s.anon.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "security" in schema["paths"]["/v1/invalidate"]["post"]
    assert s.anon.get("/v1/config").json()["http"]["auth_required"] is True
    assert TOKEN not in s.anon.get("/v1/config").text
    server_logs = [r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert server_logs and not any(TOKEN in m for m in server_logs)
    assert TOKEN not in repr(s.app.state.admin_token)


def test_auth_off_on_loopback_and_bind_policy(stack):
    assert stack.anon.post("/v1/invalidate", json={"all": True}).status_code == 200
    with pytest.raises(InsecureBind):
        create_app(stack.manager, address="0.0.0.0:9091")
    with pytest.raises(InsecureBind):
        create_app(stack.manager, address="[::]:9091")
    with pytest.raises(InsecureBind):
        AdminToken("short")
    create_app(stack.manager, address="0.0.0.0:9091", admin_token=AdminToken(TOKEN))
    create_app(stack.manager, address="localhost:9091")
    create_app(stack.manager, address="[::1]:9091")


# ---------------------------------------------------------------------------------------------- concurrency


def test_concurrent_registrations_and_invalidations_during_saves_and_restores(stack):
    _, descs = stack.engine_pages()
    stack.http.post("/v1/engines", json=reg_body(descs, engine_id="busy", codec="fp8"))
    errors: list[BaseException] = []
    stop = threading.Event()
    restored = [0]

    def data_path():
        try:
            i = 0
            while not stop.is_set():
                work = chunks(2, f"w{i % 5}-", base=(i % 4) * 8)
                stack.client.save("busy", work)
                lk = stack.client.lookup("busy", [c.key for c in work])
                res = stack.client.restore("busy", work[:lk.count], lease_id=lk.lease_id) if lk.count else None
                if lk.count:
                    restored[0] += sum(res.restored)
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def control(k: int):
        try:
            with httpx.Client(base_url=stack.server.url, timeout=30) as http:
                _, own = stack.engine_pages(seed=k)
                for j in range(4):
                    r = http.post("/v1/engines", json=reg_body(own, engine_id=f"c{k}-{j}"))
                    assert r.status_code == 201, r.text
                    r = http.post("/v1/invalidate", json={"engine_id": "busy"} if j % 2 else {"all": True})
                    assert r.status_code == 200, r.text
                    assert http.get("/metrics").status_code == 200
                    assert http.delete(f"/v1/engines/c{k}-{j}").status_code == 204
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=data_path) for _ in range(2)]
    controls = [threading.Thread(target=control, args=(k,)) for k in range(3)]
    for t in workers + controls:
        t.start()
    for t in controls:
        t.join(60)
    stop.set()
    for t in workers:
        t.join(60)
    assert not errors, errors
    assert restored[0] > 0
    assert [e["engine_id"] for e in stack.http.get("/v1/engines").json()["engines"]] == ["busy"]
    assert stack.http.delete("/v1/engines/busy").status_code == 204
    st = stack.manager.stats()
    assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes, st.workspace_bytes,
            st.inflight_requests) == (0, 0, 0, 0, 0, 0)


def test_racing_registrations_of_one_pages_file_admit_exactly_one(stack):
    _, descs = stack.engine_pages()
    answers: list = [None] * 6
    start = threading.Barrier(6)

    def register(i: int) -> None:
        with httpx.Client(base_url=stack.server.url, timeout=30) as http:
            start.wait()
            answers[i] = http.post("/v1/engines", json=reg_body(descs, engine_id=f"race-{i}"))

    threads = [threading.Thread(target=register, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 409, 409, 409, 409, 409], [r.text for r in answers]
    assert all(r.json()["code"] == "handle_in_use" for r in answers if r.status_code == 409)
    assert len(stack.manager.list_engines()) == 1


def test_delete_waits_for_outstanding_work(stack, monkeypatch):
    import orbitkv_fs.manager.save as manager_mod

    _, descs = stack.engine_pages()
    stack.http.post("/v1/engines", json=reg_body(descs, engine_id="slow", codec="fp8"))
    entered, release = threading.Event(), threading.Event()
    real_encode = manager_mod.encode_segment

    def blocking_encode(*args, **kw):  # fault injection: an encode that takes as long as the test wants
        entered.set()
        release.wait(30)
        return real_encode(*args, **kw)

    monkeypatch.setattr(manager_mod, "encode_segment", blocking_encode)
    result = {}
    saver = threading.Thread(target=lambda: result.setdefault("save", stack.client.save("slow", chunks(1))))
    saver.start()
    assert entered.wait(10)
    # A short wait gives up: 409, and the engine stays registered.
    assert_error(stack.http.delete("/v1/engines/slow", params={"timeout_s": 0.2}), 409, "engine_busy")
    assert stack.http.get("/v1/engines/slow").status_code == 200
    answered = {}
    deleter = threading.Thread(target=lambda: answered.setdefault("r", stack.http.delete("/v1/engines/slow")))
    deleter.start()
    time.sleep(0.5)
    assert "r" not in answered  # still waiting for the save
    release.set()
    deleter.join(30)
    saver.join(30)
    assert answered["r"].status_code == 204
    assert result["save"].segments == 2 * L  # the outstanding save completed
    assert_error(stack.http.delete("/v1/engines/slow", params={"timeout_s": 0}), 422, "invalid_request")


# ---------------------------------------------------------------------------------------------- peers, CLI


def test_peer_routes_need_the_token_and_export_metrics(tmp_path):
    from orbitkv_fs.peers import PeerNode, transport_available

    if not transport_available():
        pytest.skip("mooncake Transfer Engine not importable")
    manager = Manager(ManagerConfig(pool_size=4 << 20, shm_dir=SHM, device="cpu"))
    node = PeerNode(manager)
    server = HttpServer(create_app(manager, admin_token=AdminToken(TOKEN), peer_node=node), "127.0.0.1", 0).start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert_error(http.post("/v1/peers", json={"address": "127.0.0.1:1"}), 401, "unauthorized")
            assert http.get("/v1/peers").json()["peers"] == []
            r = http.post("/v1/peers", json={"address": "127.0.0.1:1"}, headers=auth)
            assert r.status_code == 201, r.text
            assert_error(http.delete("/v1/peers/127.0.0.1:1"), 401, "unauthorized")
            ms = metrics(http)
            assert m1(ms, "orbitkv_peers", state="ok") == 1
            for name in ("orbitkv_peer_lookups_total", "orbitkv_peer_fetched_bytes_total",
                         "orbitkv_peer_hit_latency_seconds_count", "orbitkv_peer_staging_bytes",
                         "orbitkv_peer_served_connections", "orbitkv_peer_served_connections_closed_total"):
                assert (name, ()) in ms, name
            assert ("orbitkv_hits_total", (("tier", "peer"),)) in ms
            assert http.get("/v1/stats").json()["peers"]["address"] == node.address
            assert "/v1/peers" in http.get("/openapi.json").json()["paths"]
            assert http.delete("/v1/peers/127.0.0.1:1", headers=auth).status_code == 204
    finally:
        server.close()
        node.close()
        manager.close()


def _cli(args, env_token=None):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ORBITKV_ADMIN_TOKEN"}
    if env_token:
        env["ORBITKV_ADMIN_TOKEN"] = env_token
    return subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--device", "cpu", "--pool-size", "16mb",
                             "--data-plane", "tcp://127.0.0.1:0", "--shm-dir", SHM, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _await_line(p, pattern: str, lines: list[str], timeout: float = 60.0) -> str:
    """The first group of ``pattern`` in the CLI's output (every line read kept in ``lines``)."""
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m.group(1)
    raise AssertionError("".join(lines))


def test_cli_refuses_a_public_address_without_a_token():
    p = _cli(["--http-addr", "0.0.0.0:0"])
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "without an admin token" in out
    assert "orbitkv-arena" not in out  # refused before the Manager made its arena


def test_cli_serves_with_a_token_on_a_public_address():
    import signal

    p = _cli(["--http-addr", "0.0.0.0:0", "--log-level", "info"], env_token=TOKEN)
    lines: list[str] = []
    try:
        port = _await_line(p, r"http http://0\.0\.0\.0:(\d+) \(admin token required\)", lines)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/readyz").json()["status"] == "ready"
            assert_error(http.post("/v1/invalidate", json={"all": True}), 401, "unauthorized")
            r = http.post("/v1/invalidate", json={"all": True}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
            assert http.get("/v1/config").json()["http"]["auth_required"] is True
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    lines.append(out)
    assert p.returncode == 0
    text = "".join(lines)
    assert "POST /v1/invalidate" in text  # the access log is on at info ...
    assert TOKEN not in text  # ... and never shows the token


# ---------------------------------------------------------------------------------------------- browsers, logs


def test_cross_site_requests_cannot_change_anything_without_a_token(stack):
    """With no token (the default) a web page must not drive the API: a "simple" cross-site request (a
    foreign Origin, no body or text/plain, no preflight) to any mutating endpoint is refused, and so is a
    request naming a host that is not loopback (a DNS-rebound page). curl and the connectors, which send
    no Origin, go on as before."""
    _, descs = stack.engine_pages()
    simple = {"Content-Type": "text/plain"}
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
        for method, path, content in (("POST", "/v1/admin/flush-dram", None),
                                      ("POST", "/v1/invalidate", b'{"all": true}'),
                                      ("DELETE", "/v1/engines/anything", None),
                                      ("POST", "/v1/engines", b"{}")):
            r = stack.anon.request(method, path, content=content, headers={**simple, "Origin": origin})
            assert_error(r, 403, "cross_origin")
    r = stack.anon.post("/v1/admin/flush-dram", headers={"Sec-Fetch-Site": "cross-site"})
    assert_error(r, 403, "cross_origin")
    r = stack.anon.get("/v1/engines", headers={"Host": "attacker.example:9091"})
    assert_error(r, 403, "bad_host")
    assert stack.manager.stats().engines == 0
    # Same origin, or no Origin at all (curl, connectors): served.
    own = stack.server.url
    assert stack.anon.post("/v1/admin/flush-dram", headers={"Origin": own}).status_code == 200
    assert stack.anon.post("/v1/admin/flush-dram").status_code == 200
    assert stack.anon.post("/v1/engines", json=reg_body(descs)).status_code == 201
    assert stack.anon.get("/v1/engines", headers={"Origin": "http://evil.example"}).status_code == 200  # reads


def test_the_access_log_never_writes_query_strings(secured, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "query-secret-0123456789"
    assert secured.http.get(f"/v1/stats?token={secret}").status_code == 200
    assert secured.anon.get(f"/healthz?token={secret}&x=1").status_code == 200
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any("/v1/stats" in m for m in access) and any("/healthz" in m for m in access), access
    assert not any(secret in r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))


def test_cli_starts_at_log_level_trace():
    import signal

    p = _cli(["--http-addr", "127.0.0.1:0", "--log-level", "trace"])
    lines: list[str] = []
    try:
        url = _await_line(p, r"http (http://127\.0\.0\.1:\d+)", lines)
        assert httpx.get(url + "/healthz", timeout=30).status_code == 200
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, "".join(lines) + out
    assert "TRACE" in "".join(lines) + out  # uvicorn's trace lines come through
