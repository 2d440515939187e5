"""The data plane's transport: ZMTP 3.0 on plain sockets, against a Manager in this process.

Interop with libzmq (REQ and DEALER clients), TCP and ipc endpoints, hostile bytes at every layer (not
ZMTP, bad frames, oversized and over-long messages, undecodable requests, values the schema lets through),
a client that waits for a server starting late and times out on one that is gone, binding over a stale
socket file but not over a live server, and close() answering the request in flight."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import msgspec
import pytest
import zmq

from orbitkv_fs import dataplane as dp
from orbitkv_fs.access import AdminRequired, AdminToken
from orbitkv_fs.dataplane import DataPlaneServer, RemoteClient
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.geometry import EngineRegistration, GeometryError
from orbitkv_fs.manager import Manager, ManagerConfig, RequestError, UnknownEngine
from orbitkv_fs.pages import host_engine_pages
from manager_process import peer_closed as _closed
from polling import wait_until


@pytest.fixture
def manager():
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
        yield m


@pytest.fixture
def server(manager, tmp_path):
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock", workers=1)
    yield srv
    srv.close()


def _raw(srv: DataPlaneServer) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(srv.endpoint[len("ipc://"):])
    return s


def _handshaken(srv: DataPlaneServer, socket_type: bytes = b"DEALER") -> tuple[socket.socket, object]:
    s = _raw(srv)
    rfile = s.makefile("rb")
    dp._handshake(s, rfile, socket_type, (b"ROUTER",))
    return s, rfile


def test_tcp_endpoint_resolves_its_port_and_serves(manager):
    srv = DataPlaneServer(manager, "tcp://127.0.0.1:0")
    try:
        assert srv.endpoint.startswith("tcp://127.0.0.1:") and not srv.endpoint.endswith(":0")
        c = RemoteClient(srv.endpoint, timeout=10)
        c.ping()
        assert c.stats().engines == 0
        with pytest.raises(UnknownEngine):
            c.lookup("nope", [bytes(16)])
        c.close()
    finally:
        srv.close()


def test_libzmq_dealer_and_req_clients_are_served(server):
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 10_000)
        d.connect(server.endpoint)
        # A DEALER's envelope is its own: two frames of it come back in front of the reply.
        d.send_multipart([b"corr-id", b"", msgspec.msgpack.encode(dp.Stats())])
        tag, empty, reply = d.recv_multipart()
        assert (tag, empty, reply[:1]) == (b"corr-id", b"", b"\x00")
        assert msgspec.msgpack.decode(reply[1:], type=dp.ManagerStats).engines == 0
        r = ctx.socket(zmq.REQ)
        r.setsockopt(zmq.RCVTIMEO, 10_000)
        r.connect(server.endpoint)
        r.send(msgspec.msgpack.encode(dp.Lookup("nope", [bytes(16)])))
        err = msgspec.msgpack.decode(r.recv()[1:], type=dp.WireError)
        assert err.type == "UnknownEngine"
        d.close(0)
        r.close(0)
    finally:
        ctx.term()


@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64),  # not ZMTP
    dp._SIGNATURE + b"\x02\x00" + bytes(52),  # ZMTP 2
    dp._SIGNATURE + b"\x03\x00" + b"PLAIN".ljust(20, b"\x00") + bytes(32),  # a mechanism not served
])
def test_non_zmtp_peers_are_dropped_and_the_server_keeps_serving(server, junk):
    s = _raw(server)
    s.sendall(junk)
    assert _closed(s)
    s.close()
    c = RemoteClient(server.endpoint, timeout=10)
    c.ping()
    c.close()


def test_incompatible_socket_type_is_dropped(server):
    s = _raw(server)
    s.sendall(dp._GREETING + dp._ready(b"PUB"))
    assert _closed(s)
    s.close()


def test_a_full_server_displaces_idle_anonymous_connections_and_refuses_readably(manager, tmp_path, caplog):
    """At the connection limit a new connection displaces the anonymous one idle longest; the connections
    an engine acted on are never displaced, and when every slot is one a new connection is refused with a
    ZMTP ERROR the client reads (DataPlaneBusy), not a bare EOF. Each is counted."""
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock", limits=dp.DataPlaneLimits(max_connections=2))
    pages, descs = host_engine_pages(num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
    reg = EngineRegistration(model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16, num_heads=1,
                             head_dim=64, dtype="bfloat16", tensors=descs)
    try:
        idle, _ = _handshaken(srv)
        engine = RemoteClient(srv.endpoint, timeout=10)
        eid = engine.register(reg).engine_id  # this connection acts for the engine from now on
        idle.settimeout(0.3)
        assert _closed(idle) is False  # two slots, two connections
        idle.settimeout(10)
        newcomer = RemoteClient(srv.endpoint, timeout=10)
        newcomer.ping()  # displaced the idle anonymous one
        assert _closed(idle)
        assert engine.lookup(eid, [bytes(16)]).count == 0  # the engine's connection was kept
        # Both slots an engine's: a newcomer is told why, and the engine goes on being served.
        # A second engine thread (its connection lives as long as the thread): it displaces the anonymous
        # newcomer, then acts for the engine.
        looked, done = threading.Event(), threading.Event()
        second = threading.Thread(target=lambda: (engine.lookup(eid, [bytes(16)]), looked.set(), done.wait(30)))
        second.start()
        assert looked.wait(10)
        with caplog.at_level("WARNING", logger=dp.__name__):
            late = RemoteClient(srv.endpoint, timeout=10)
            with pytest.raises(dp.DataPlaneBusy, match="2 connections open"):
                late.ping()
            assert wait_until(lambda: "refusing more" in caplog.text)  # logged on the accept thread
        assert engine.lookup(eid, [bytes(16)]).count == 0
        st = srv.stats()
        assert (st.connections, st.engine_connections) == (2, 2)
        assert (st.connections_displaced_total, st.connections_refused_total) == (2, 1)
        done.set()
        second.join(10)
        engine.unregister(eid)
        engine.close(); newcomer.close(); late.close()
        idle.close()
    finally:
        srv.close()
        pages.close()


def test_one_user_with_many_engines_cannot_hold_every_slot(manager, tmp_path, monkeypatch):
    """Engines' connections are kept from displacement only within quotas: per engine, and per OS user (a
    quarter of the limit), so registering engine after engine does not buy every slot."""
    monkeypatch.setattr(dp, "MAX_ENGINE_CONNECTIONS", 1)
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock", limits=dp.DataPlaneLimits(max_connections=8))
    made = [host_engine_pages(num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
            for _ in range(3)]
    clients = [RemoteClient(srv.endpoint, timeout=10) for _ in made]
    try:
        for c, (_, descs) in zip(clients, made):
            c.register(EngineRegistration(model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16,
                                          num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs))
        st = srv.stats()
        assert (st.connections, st.engine_connections) == (3, 2)  # this user's quota: 8 // 4
        ids = [e.engine_id for e in manager.list_engines()]
        for c, eid in zip(clients, ids):
            c.unregister(eid)
    finally:
        for c in clients:
            c.close()
        srv.close()
        for pages, _ in made:
            pages.close()


def test_an_oversized_ready_command_is_dropped(server):
    """Before the handshake ends a peer may send a READY of a few KiB, not a message-sized one."""
    s = _raw(server)
    s.sendall(dp._GREETING + b"\x06" + struct.pack(">Q", dp._MAX_READY + 1) + b"\x05READY")
    assert _closed(s)
    s.close()


@pytest.mark.parametrize("frames", [
    b"\x08\x00",  # reserved flag bit
    b"\x02" + struct.pack(">Q", 1001),  # one frame over the limit
    b"\x03" + struct.pack(">Q", 600) + bytes(600) + b"\x02" + struct.pack(">Q", 401),  # two, together over it
    b"\x01\x00" * (dp.MAX_FRAMES + 1) + b"\x00\x00",  # too many frames
    b"\x01\x00\x04\x00",  # a command inside a message
])
def test_bad_framing_closes_that_connection_only(server, frames, monkeypatch):
    limit = dp.MAX_MESSAGE
    monkeypatch.setattr(dp, "MAX_MESSAGE", 1000)
    s, _ = _handshaken(server)
    s.sendall(frames)
    assert _closed(s)
    s.close()
    # The real limit again: a stats reply alone is over 1000 bytes.
    monkeypatch.setattr(dp, "MAX_MESSAGE", limit)
    c = RemoteClient(server.endpoint, timeout=10)
    assert c.stats().engines == 0
    c.close()


@pytest.mark.parametrize("body, error", [
    (b"", "malformed request"),
    (b"\xc1", "malformed request"),
    (msgspec.msgpack.encode(["lookup", "e", [], "not-a-bool"]), "malformed request"),
    (msgspec.msgpack.encode(["lookup", "e", [], True, 7]), "malformed request"),  # a credential not a str
    (b"\x94\xa4save\xa1e" + b"\x91" * 100_000 + b"\xc0\xa0", "malformed request"),  # chunks nested 100,000 deep
    (msgspec.msgpack.encode(["nosuchcall"]), "malformed request"),
    (os.urandom(300), "malformed request"),  # a long frame of noise
    (msgspec.msgpack.encode(dp.Invalidate(namespace=b"abc")), ""),  # passes the schema, not the Manager
])
def test_undecodable_or_invalid_requests_get_typed_errors(server, body, error):
    s, rfile = _handshaken(server, b"REQ")
    s.sendall(dp._DELIMITER + dp._frame(body))
    frames = dp._read_message(rfile)
    assert frames[0] == b"" and frames[1][:1] == b"\x01"
    err = msgspec.msgpack.decode(frames[1][1:], type=dp.WireError)
    assert err.type == "RequestError" and error in err.message
    # The same connection goes on serving.
    s.sendall(dp._DELIMITER + dp._frame(msgspec.msgpack.encode(dp.Ping())))
    assert dp._read_message(rfile) == [b"", b"\x00\xc0"]
    s.close()


def test_a_short_packed_key_is_a_request_error_not_an_internal_one(manager, tmp_path, caplog):
    """An operator's data-plane Invalidate whose key is 10 bytes: a typed request error naming the key, no
    traceback. Without the admin token the keys are not read at all: the call is refused for who sends it."""
    token = "t" * 32
    server = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock", admin_token=AdminToken(token))
    try:
        s, rfile = _handshaken(server, b"REQ")
        with caplog.at_level("DEBUG", logger=dp.__name__):
            s.sendall(dp._DELIMITER + dp._frame(msgspec.msgpack.encode(dp.Invalidate(keys=[b"k" * 10],
                                                                                     admin_token=token))))
            frames = dp._read_message(rfile)
        err = msgspec.msgpack.decode(frames[1][1:], type=dp.WireError)
        assert (err.type, err.message) == ("RequestError", "keys[0]: a packed object key is 36 bytes, not 10")
        assert not [r for r in caplog.records if r.exc_info]
        s.close()
        c = RemoteClient(server.endpoint, timeout=10)
        with pytest.raises(RequestError, match="keys\\[0\\]"):
            c._call(dp.Invalidate(keys=[b"k" * 40], admin_token=token), dp.InvalidateResult)
        with pytest.raises(AdminRequired):
            c._call(dp.Invalidate(keys=[b"k" * 40]), dp.InvalidateResult)
        c.close()
    finally:
        server.close()


def _send(s: socket.socket, rfile, body: bytes) -> dp.WireError | bytes:
    """One request on a raw REQ connection: its error, or its reply's msgpack."""
    s.sendall(dp._DELIMITER + dp._frame(body))
    empty, reply = dp._read_message(rfile)
    assert empty == b""
    return msgspec.msgpack.decode(reply[1:], type=dp.WireError) if reply[:1] == b"\x01" else reply[1:]


def _chunks(n: int) -> bytes:
    """msgpack of ``n`` empty chunks ([b"", []]): four bytes each on the wire, about 120 bytes each once built."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x92\xc4\x00\x90" * n


def test_an_engine_calls_chunks_are_decoded_only_once_its_credential_passed(server, tmp_path):
    """What a process without an engine's credential sends as chunks or keys is never built: the call is
    refused by whom it names and what it carries (UnknownEngine, Unauthenticated, AdminRequired), whatever
    its chunks hold. The engine itself gets a request error naming the field. A check after the decode
    answers RequestError to the first three (and builds what they sent first)."""
    pages, descs = host_engine_pages(num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
    c = RemoteClient(server.endpoint, timeout=10)
    try:
        info = c.register(EngineRegistration(model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16,
                                             num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs))
        eid, cred = info.engine_id, info.credential
        s, rfile = _handshaken(server, b"REQ")
        bad = msgspec.Raw(msgspec.msgpack.encode("not-a-list"))  # where the chunks go
        calls = {"save": lambda e, c: ["save", e, bad, c], "lookup": lambda e, c: ["lookup", e, bad, True, c],
                 "restore": lambda e, c: ["restore", e, bad, 0, None, c]}
        for call, body in calls.items():
            assert _send(s, rfile, msgspec.msgpack.encode(body("nope", ""))).type == "UnknownEngine"
            assert _send(s, rfile, msgspec.msgpack.encode(body(eid, "0" * 64))).type == "Unauthenticated"
            err = _send(s, rfile, msgspec.msgpack.encode(body(eid, cred)))
            assert err.type == "RequestError" and err.message.startswith("malformed request: chunks:"), err
        inval = [None, None, None, None, False, "", ""]  # keys, chunks, namespace, engine_id, all, credential, token
        for fields, error in (({0: bad}, "AdminRequired"), ({1: bad, 3: "nope"}, "UnknownEngine"),
                              ({1: bad, 3: eid, 5: "0" * 64}, "Unauthenticated"),
                              ({1: bad, 3: eid, 5: cred}, "RequestError")):
            body = list(inval)
            for i, v in fields.items():
                body[i] = v
            err = _send(s, rfile, msgspec.msgpack.encode(["invalidate"] + body))
            assert err.type == error, (fields, err)
        # A credential that passed, and as many chunks as the bound allows once more: refused from the list's
        # header alone.
        err = _send(s, rfile, b"\x94\xa4save" + msgspec.msgpack.encode(eid) + _chunks(dp.MAX_ITEMS + 1) +
                    msgspec.msgpack.encode(cred))
        assert err.type == "RequestError" and f"length <= {dp.MAX_ITEMS}" in err.message
        assert server.stats().auth_failures_total == 5
        assert c.save(eid, [dp.ChunkBlocks(bytes(16), [0])]).chunks_saved == 1  # the engine is served on
        s.close()
    finally:
        c.close()
        pages.close()


def test_an_engines_lists_count_against_the_buffer_bound_before_they_are_built(manager, tmp_path):
    """What an engine call's chunks will build is counted against ``max_buffered_bytes`` (13 bytes a byte of
    msgpack past the first 64 KiB) once its credential passed and before they are decoded: lists that could
    never fit are a request error that says so, lists that do not fit beside what other connections hold are
    DataPlaneBusy, and once those are gone the same request is decoded (here: its 15-byte key refused by the
    wire schema). Counted or not, nothing of it stays held."""
    limits = dp.DataPlaneLimits(max_buffered_bytes=24 << 20)
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock", limits=limits)
    pages, descs = host_engine_pages(num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
    c = RemoteClient(srv.endpoint, timeout=10)
    try:
        info = c.register(EngineRegistration(model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16,
                                             num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs))

        def save(chunks: list) -> bytes:
            return msgspec.msgpack.encode(["save", info.engine_id, chunks, info.credential])

        short_key = [b"k" * 15, [1]]
        s, rfile = _handshaken(srv, b"REQ")
        big = save([short_key] + [[b"k" * 16, [1] * 1000]] * 2100)  # 2.1 MB: would build ~27 MB
        err = _send(s, rfile, big)
        assert err.type == "RequestError" and "--data-plane-max-buffered): send fewer chunks" in err.message, err
        fits = save([short_key] + [[b"k" * 16, [1] * 1000]] * 1000)  # 1 MB: ~12.5 MB
        hold, hold_file = _handshaken(srv, b"REQ")  # another connection holds 12 MiB of a message it has not finished
        hold.sendall(dp._DELIMITER + bytes((dp._LONG,)) + struct.pack(">Q", 13 << 20) + bytes(12 << 20))
        assert wait_until(lambda: srv.stats().buffered_bytes >= (12 << 20) - dp._FREE_BYTES, timeout=10)
        assert _send(s, rfile, fits).type == "DataPlaneBusy"
        hold_file.close()
        hold.close()
        assert wait_until(lambda: srv.stats().buffered_bytes == 0, timeout=10)
        err = _send(s, rfile, fits)
        assert err.type == "RequestError" and "Expected `bytes` of length >= 16 - at `$[0][0]`" in err.message, err
        assert wait_until(lambda: srv.stats().buffered_bytes == 0, timeout=10)  # given back once it is answered
        no_blocks = _send(s, rfile, save([[b"k" * 16, []]]))
        assert no_blocks.type == "RequestError" and "length >= 1" in no_blocks.message
        s.close()
    finally:
        c.close()
        srv.close()
        pages.close()


def test_one_os_user_may_have_so_many_engines_and_tensors_registered(tmp_path, monkeypatch):
    """Registrations from another process count against their OS user's quota (engines, and tensors across
    them): over either is TooManyEngines, counted, with nothing of it mapped or claimed (its pages register
    once the user unregisters an engine). In-process registrations are not counted. Without the quota one
    local user could register engines until the Manager's memory ran out (about 1.6 KB a tensor, 12.8 MiB a
    registration of 8,192)."""
    from orbitkv_fs.manager import TooManyEngines

    cfg = ManagerConfig(pool_size=1 << 20, device="cpu", max_engines_per_user=2, max_tensors_per_user=6)
    made = []
    imported = []  # registrations whose tensors were mapped
    real_import = Manager._import_tensors
    monkeypatch.setattr(Manager, "_import_tensors", lambda self, reg, *a: imported.append(reg) or
                        real_import(self, reg, *a))

    def reg(layers: int) -> EngineRegistration:
        pages, descs = host_engine_pages(num_layers=layers, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
        made.append(pages)
        return EngineRegistration(model="m", num_layers=layers, layer_start=0, layer_end=layers, block_size=16,
                                  num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs)

    with Manager(cfg) as m:
        srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock")
        c = RemoteClient(srv.endpoint, timeout=10)
        try:
            first = c.register(reg(1))  # 2 tensors
            with pytest.raises(TooManyEngines, match="1 engines of 2 tensors registered; one more, of 6 tensors,"):
                c.register(reg(3))  # 2 + 6 > 6 tensors
            c.register(reg(1))  # 4 tensors, 2 engines
            third = reg(1)
            with pytest.raises(TooManyEngines, match="2 engines of 4 tensors registered; one more, of 2 tensors,"):
                c.register(third)  # 6 tensors would do, a third engine would not
            assert len(imported) == 2  # the refused ones mapped nothing
            m.register_engine(reg(2))  # in-process: not counted
            assert m.stats().registrations_refused == 2 and m.stats().engines == 3
            c.unregister(first.engine_id)
            assert c.register(third).engine_id  # its pages were never claimed
        finally:
            c.close()
            srv.close()
            for p in made:
                p.close()


def test_an_engines_tensors_lie_in_at_most_eight_pages_files(manager):
    """Each pages file the Manager maps holds one of its descriptors (Python's mmap keeps one) and a memory
    map: a registration of one file a layer for 4,096 layers took 4,096 of them before it was refused for
    something else (docs/results/2026-12-05-dataplane-bulk). Nine files are refused at the ninth, before it
    is opened; eight register."""
    def engine(files: int):
        parts = [host_engine_pages(num_layers=1, layer_start=i, num_blocks=4, block_size=16, num_heads=1,
                                   head_dim=64) for i in range(files)]
        reg = EngineRegistration(model="m", num_layers=files, layer_start=0, layer_end=files, block_size=16,
                                 num_heads=1, head_dim=64, dtype="bfloat16", tensors=[d for _, ds in parts for d in ds])
        return [p for p, _ in parts], reg

    nine, reg9 = engine(9)
    eight, reg8 = engine(8)
    try:
        with pytest.raises(GeometryError, match="at most 8 pages files") as e:
            manager.register_engine(reg9)
        assert e.value.field == "tensors[16].handle.path"
        assert manager.register_engine(reg8).segments_per_chunk == 16
    finally:
        for p in nine + eight:
            p.close()


def test_racing_registrations_of_one_user_admit_exactly_its_quota(tmp_path):
    """Eight registrations of one OS user at once, each mapping its own pages (milliseconds between the quota's
    first look and the engine's insertion), against a quota of three engines: exactly three are registered."""
    from orbitkv_fs.manager import TooManyEngines

    made = [host_engine_pages(num_layers=8, num_blocks=4, block_size=16, num_heads=1, head_dim=64)
            for _ in range(8)]
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu", max_engines_per_user=3)) as m:
        srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock", workers=8)
        c = RemoteClient(srv.endpoint, timeout=30)
        outcomes: list[str] = []
        start = threading.Barrier(8)

        def register(descs) -> None:
            start.wait()
            try:
                c.register(EngineRegistration(model="m", num_layers=8, layer_start=0, layer_end=8, block_size=16,
                                              num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs))
                outcomes.append("ok")
            except TooManyEngines:
                outcomes.append("refused")

        threads = [threading.Thread(target=register, args=(descs,)) for _, descs in made]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert sorted(outcomes) == ["ok"] * 3 + ["refused"] * 5 and m.stats().engines == 3
        finally:
            c.close()
            srv.close()
            for p, _ in made:
                p.close()


def test_a_registration_bigger_than_any_engine_is_refused_before_it_is_built(server):
    """Anyone may register: a registration of more tensors than MAX_TENSORS, or a tensor of more dimensions
    than MAX_DIMS, is a request error from the lists' headers. Without the bounds 9,000 tensors are built and
    then refused by the checks of each one."""
    s, rfile = _handshaken(server, b"REQ")
    tensor = {"layer": 0, "role": "kv", "layout": "vllm_packed", "shape": [1], "strides": [1], "dtype": "bfloat16",
              "handle": {"type": "host", "path": "/nope", "offset": 0}}
    reg = {"model": "m", "num_layers": 1, "layer_start": 0, "layer_end": 1, "block_size": 16, "num_heads": 1,
           "head_dim": 64, "dtype": "bfloat16"}
    too_many = _send(s, rfile, msgspec.msgpack.encode(["register", dict(reg, tensors=[tensor] * 9000)]))
    assert too_many.type == "RequestError" and "length <= 8192" in too_many.message
    deep = dict(tensor, shape=[1] * 9, strides=[1] * 9)
    too_deep = _send(s, rfile, msgspec.msgpack.encode(["register", dict(reg, tensors=[deep])]))
    assert too_deep.type == "RequestError" and "length <= 8" in too_deep.message
    s.close()


def test_request_errors_reraise_as_the_embedded_classes(server):
    c = RemoteClient(server.endpoint, timeout=10)
    with pytest.raises(RequestError):
        c.invalidate()
    with pytest.raises(OrbitKVError):
        c.release(12345)
    c.close()


def test_client_waits_for_a_late_server_and_times_out_on_a_gone_one(manager, tmp_path):
    endpoint = f"ipc://{tmp_path}/late.sock"
    c = RemoteClient(endpoint, timeout=20)
    started: list[DataPlaneServer] = []
    t = threading.Timer(0.3, lambda: started.append(DataPlaneServer(manager, endpoint)))
    t.start()
    c.ping()  # sent before anything listened
    t.join()
    started[0].close()
    c2 = RemoteClient(endpoint, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(OrbitKVError, match="no answer"):
        c2.ping()
    assert time.monotonic() - t0 < 5
    with pytest.raises(OrbitKVError, match="no answer"):
        c.ping()  # its connection was closed by the server
    c.close()
    c2.close()


def test_a_restarted_server_is_reached_again_without_a_failed_call(tmp_path):
    """The Manager process restarted: the client's old connection is dead. The next call reconnects once
    and succeeds instead of failing with "connection lost"; with nothing listening it fails at once,
    not after the call timeout."""
    endpoint = f"ipc://{tmp_path}/restart.sock"
    c = RemoteClient(endpoint, timeout=30)
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m1:
        srv = DataPlaneServer(m1, endpoint)
        c.ping()
        srv.close()
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m2:
        srv = DataPlaneServer(m2, endpoint)
        try:
            assert c.stats().engines == 0  # answered by the new server
        finally:
            srv.close()
    t0 = time.monotonic()
    with pytest.raises(OrbitKVError, match="nothing listens"):
        c.ping()
    assert time.monotonic() - t0 < 5
    c.close()


def test_stale_socket_file_is_replaced_but_a_live_server_is_not(manager, tmp_path):
    path = f"{tmp_path}/s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    srv = DataPlaneServer(manager, f"ipc://{path}")
    try:
        with pytest.raises(OrbitKVError, match="another process serves it"):
            DataPlaneServer(manager, f"ipc://{path}")
        RemoteClient(srv.endpoint, timeout=10).ping()
    finally:
        srv.close()
    assert not os.path.exists(path)


def test_close_answers_the_request_in_flight(manager, tmp_path, monkeypatch):
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/c.sock")
    entered = threading.Event()
    real = manager.stats

    def slow_stats():
        entered.set()
        time.sleep(0.5)
        return real()

    monkeypatch.setattr(manager, "stats", slow_stats)
    c = RemoteClient(srv.endpoint, timeout=10)
    got: list = []
    t = threading.Thread(target=lambda: got.append(c.stats()))
    t.start()
    assert entered.wait(10)
    srv.close()
    t.join(10)
    assert got and got[0].engines == 0
    with pytest.raises(OrbitKVError, match="no answer"):
        RemoteClient(srv.endpoint, timeout=0.2).ping()
    c.close()


def test_one_client_shared_by_threads(server):
    c = RemoteClient(server.endpoint, timeout=30)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(50):
                assert c.stats().engines == 0
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    c.close()


@pytest.mark.parametrize("endpoint, error", [
    ("tcp://0.0.0.0:0", "not loopback"),
    ("tcp://*:9092", "not loopback"),
    ("tcp://127.0.0.1", "tcp://HOST:PORT"),
    ("udp://127.0.0.1:1", "expected ipc:// or tcp://"),
    ("ipc://", "no path"),
])
def test_bad_or_non_loopback_endpoints_are_refused(manager, endpoint, error):
    with pytest.raises(ValueError, match=error):
        DataPlaneServer(manager, endpoint)


class _FailingAccept:
    """A listener whose accept() fails like a process out of descriptors, then works again."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock, self.failures = sock, failures

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(24, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_accept_survives_a_transient_error(manager, tmp_path):
    # EMFILE on accept (descriptors run out for a moment) must not end the accept thread for good.
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock")
    try:
        c = RemoteClient(srv.endpoint, timeout=10)
        c.ping()  # the accept thread is now blocked in the real listener's accept()
        flaky = _FailingAccept(srv._listener, failures=2)
        srv._listener = flaky
        _raw(srv).close()  # wakes the old accept() once; the next calls go to the flaky listener
        c2 = RemoteClient(srv.endpoint, timeout=10)
        c2.ping()
        assert flaky.failures == 0
        c.close(); c2.close()
    finally:
        srv.close()


def test_a_stalled_handshake_or_message_is_dropped(manager, tmp_path, monkeypatch):
    # A peer that connects and sends nothing, half a greeting, or a frame header announcing bytes that never
    # come holds a server thread (and a connection slot) only for the handshake/message time limit.
    monkeypatch.setattr(dp, "STALL_TIMEOUT_S", 0.3)
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock")
    try:
        silent = _raw(srv)
        partial = _raw(srv)
        partial.sendall(dp._GREETING[:20])
        stalled, _ = _handshaken(srv)
        stalled.sendall(dp._DELIMITER + bytes((dp._LONG,)) + struct.pack(">Q", 1 << 20) + b"x" * 100)
        for s in (silent, partial, stalled):
            assert _closed(s)
            s.close()
        RemoteClient(srv.endpoint, timeout=10).ping()
    finally:
        srv.close()


def test_close_does_not_wait_on_a_peer_that_never_reads(manager, tmp_path, monkeypatch):
    # A DEALER that pipelines requests and never reads its replies blocks the server's send; close() must
    # still end promptly.
    monkeypatch.setattr(dp, "STALL_TIMEOUT_S", 0.5)
    srv = DataPlaneServer(manager, f"ipc://{tmp_path}/dp.sock")
    s, _ = _handshaken(srv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    req = dp._frame(b"", dp._MORE) + dp._frame(msgspec.msgpack.encode(dp.Stats()))
    sender = threading.Thread(target=lambda: _send_until_blocked(s, req), daemon=True)
    sender.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 5
    s.close()


def _send_until_blocked(s: socket.socket, req: bytes) -> None:
    try:
        while True:
            s.sendall(req * 64)
    except OSError:
        pass


def test_a_dead_threads_connection_is_closed(server):
    # A client used from short-lived threads must not keep one connection (and one server thread) per
    # thread that has ended.
    c = RemoteClient(server.endpoint, timeout=10)
    for _ in range(5):
        t = threading.Thread(target=c.ping)
        t.start()
        t.join()
    import gc

    gc.collect()
    deadline = time.monotonic() + 5
    while len(server._conns) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server._conns) == 0
    c.close()


def test_no_retry_once_part_of_the_reply_came(tmp_path):
    # A connection cut after the server began its reply (it ran the request, then dropped a peer whose
    # reads stalled) must not be retried: the request would run twice.
    path = f"{tmp_path}/fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(10)
    requests: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        rfile = conn.makefile("rb")
        dp._handshake(conn, rfile, b"ROUTER", (b"REQ",))
        ok = dp._frame(b"", dp._MORE) + dp._frame(dp._OK + msgspec.msgpack.encode(None))
        requests.append(dp._read_message(rfile)[-1])
        conn.sendall(ok)
        requests.append(dp._read_message(rfile)[-1])
        conn.sendall(ok[:3])  # part of the reply, then gone
        rfile.close()
        conn.close()
        listener.settimeout(1)
        try:
            again, _ = listener.accept()  # a retry would come here
        except TimeoutError:
            return
        rfile = again.makefile("rb")
        try:
            dp._handshake(again, rfile, b"ROUTER", (b"REQ",))
            requests.append(dp._read_message(rfile)[-1])
            again.sendall(ok)
        except (OSError, EOFError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = RemoteClient(f"ipc://{path}", timeout=5)
    c.ping()
    with pytest.raises(OrbitKVError, match="connection lost"):
        c.ping()
    c.close()
    t.join(15)
    listener.close()
    assert len(requests) == 2


def test_a_call_racing_close_raises_a_typed_error(server):
    # close() from another thread can close a connection between a call's send and its read: the call
    # fails with the data plane's error (a miss to the adapters' guard), not a ValueError from the file.
    c = RemoteClient(server.endpoint, timeout=10)
    c.ping()
    c._local.conn.rfile.close()  # what close() does to it at that moment
    with pytest.raises(OrbitKVError):
        c.ping()
    c.close()


def test_tcp_connections_are_kept_alive(manager):
    # Over TCP (allow_remote) a client host that vanishes leaves a half-open connection that never reads
    # EOF; keep-alive probes end it, so it does not hold a server thread and a connection slot forever.
    srv = DataPlaneServer(manager, "tcp://127.0.0.1:0")
    try:
        c = RemoteClient(srv.endpoint, timeout=10)
        c.ping()
        (sock,) = list(srv._conns)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == dp._KEEPALIVE_IDLE_S
        c.close()
    finally:
        srv.close()
