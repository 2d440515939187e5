"""The data plane's limits under abuse, against a real ``orbitkv-cache-manager`` process: many connections
each holding most of a large message (the manager's memory stays within ``--data-plane-max-buffered``,
and the messages over it are answered DataPlaneBusy once complete), a server full of idle connections (a
registered engine and a new well-behaved client are still served), and connections dripping a message a
byte at a time (cut off at ``--data-plane-message-timeout``, however steadily the bytes come). Each limit
shows in ``/metrics`` when it bites."""

from __future__ import annotations

import resource
import socket
import struct
import threading
import time

import msgspec
import pytest

from manager_process import ManagerProcess, peer_closed
from orbitkv_fs import dataplane as dp
from orbitkv_fs.dataplane import RemoteClient
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.pages import host_engine_pages

MIB = 1 << 20


def _connect(endpoint: str) -> socket.socket:
    fam, addr = dp._parse_endpoint(endpoint)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(addr)
    return s


def _handshaken(endpoint: str) -> socket.socket:
    s = _connect(endpoint)
    dp._handshake(s, s.makefile("rb"), b"REQ", (b"ROUTER",))
    return s


def _engine(shm: str):
    pages, descs = host_engine_pages(num_layers=1, num_blocks=8, block_size=16, num_heads=1, head_dim=64,
                                     directory=shm)
    return pages, EngineRegistration(model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16,
                                     num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs)


def test_partial_large_messages_are_bounded_by_the_buffer_flag(tmp_path):
    """12 connections each send 58 MiB of a 59 MiB frame and stop: the manager holds at most the bound
    (128 MiB here: two of them) of those bytes; the others are read and dropped as they come and, once
    complete, answered DataPlaneBusy (an error the client reads). Before the bound, the manager's RSS grew
    by ~700 MB."""
    bound = 128 * MIB
    mgr = ManagerProcess("--data-plane-max-buffered", "128mb", "--data-plane-message-timeout", "60",
                         shm_dir=str(tmp_path), endpoint=f"ipc://{tmp_path}/dp.sock")
    conns: list[socket.socket] = []
    try:
        RemoteClient(mgr.endpoint, timeout=10).ping()
        base = mgr.rss()
        frame = 59 * MIB
        body = memoryview(bytearray(58 * MIB))
        head = dp._DELIMITER + bytes((dp._LONG,)) + struct.pack(">Q", frame)

        def attack() -> None:
            s = _handshaken(mgr.endpoint)
            conns.append(s)
            s.sendall(head)
            s.sendall(body)

        threads = [threading.Thread(target=attack) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(conns) == 12
        # All sent: the manager has read it (held, or dropped as it came) once its RSS stops moving.
        rss = [mgr.rss()]
        while len(rss) < 3 or rss[-1] != rss[-3]:
            time.sleep(0.25)
            rss.append(mgr.rss())
        grown = rss[-1] - base
        assert grown < bound + 40 * MIB, f"RSS grew by {grown / MIB:.0f} MiB with a {bound / MIB:.0f} MiB bound"
        held = mgr.metric("orbitkv_dataplane_buffered_bytes")
        assert 0 < held <= bound
        assert mgr.metric("orbitkv_dataplane_buffer_refusals_total") >= 10
        # Completed, a refused message is answered with an error the client reads; a held one is decoded
        # (zeros are no request: a request error).
        answers = []
        for s in conns:
            s.sendall(bytes(frame - 58 * MIB))
            empty, reply = dp._read_message(s.makefile("rb"))
            assert empty == b"" and reply[:1] == b"\x01"
            answers.append(msgspec.msgpack.decode(reply[1:], type=dp.WireError))
        busy = [a for a in answers if a.type == "DataPlaneBusy"]
        assert len(busy) >= 10 and all("--data-plane-max-buffered" in a.message for a in busy)
        assert all(a.type == "RequestError" for a in answers if a.type != "DataPlaneBusy")
        c = RemoteClient(mgr.endpoint, timeout=10)
        assert c.stats().engines == 0  # small requests are never refused
        c.close()
    finally:
        for s in conns:
            s.close()
        assert mgr.stop() == 0, mgr.log


def test_a_server_full_of_idle_connections_still_serves_an_engine_and_a_newcomer(tmp_path):
    """1,022 idle connections fill the manager with a registered engine's two: the engine keeps being
    served, a new connection of the engine and a new well-behaved client get in (each displaces an idle
    anonymous connection), never a bare EOF."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1100
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    mgr = ManagerProcess(shm_dir=str(tmp_path),  # the default limit: 1024 connections
                         endpoint=f"ipc://{tmp_path}/dp.sock")
    pages, reg = _engine(str(tmp_path))
    idle: list[socket.socket] = []
    try:
        engine = RemoteClient(mgr.endpoint, timeout=30)
        eid = engine.register(reg).engine_id
        looked, done = threading.Event(), threading.Event()
        second = threading.Thread(target=lambda: (engine.lookup(eid, [bytes(16)]), looked.set(), done.wait(120)))
        second.start()  # the engine's second thread: its second connection
        assert looked.wait(30)
        for _ in range(1022):
            idle.append(_handshaken(mgr.endpoint))  # each answered the handshake: each holds its slot
        assert engine.lookup(eid, [bytes(16)], lease=False).count == 0  # its connection was kept
        newcomer = RemoteClient(mgr.endpoint, timeout=30)
        assert newcomer.stats().engines == 1
        third: list = []
        t = threading.Thread(target=lambda: third.append(engine.lookup(eid, [bytes(16)], lease=False).count))
        t.start()  # a third engine thread: a new connection too
        t.join(30)
        assert third == [0]
        assert mgr.metric("orbitkv_dataplane_connections") >= 1023  # full (the third thread has ended)
        assert mgr.metric("orbitkv_dataplane_connections_displaced_total") >= 2
        assert mgr.metric("orbitkv_dataplane_connections_refused_total") == 0
        for s in idle:
            s.setblocking(False)
        assert sum(peer_closed(s) for s in idle) >= 2  # the displaced ones, oldest first
        assert peer_closed(idle[-1]) is False
        done.set()
        second.join(30)
        engine.unregister(eid)
        engine.close()
        newcomer.close()
    finally:
        for s in idle:
            s.close()
        pages.close()
        assert mgr.stop() == 0, mgr.log


def test_dripping_connections_are_cut_off_at_the_message_deadline(tmp_path):
    """20 connections drip a message one byte every 0.25 s (each byte arrives well within the 30 s stall
    limit that applies per receive): each is closed once its message has taken the deadline (2 s here);
    a connection dripping its handshake too. Before the deadline they stayed open as long as bytes came."""
    mgr = ManagerProcess("--data-plane-message-timeout", "2", shm_dir=str(tmp_path),
                         endpoint=f"ipc://{tmp_path}/dp.sock")
    conns: list[socket.socket] = []
    try:
        for _ in range(20):
            s = _handshaken(mgr.endpoint)
            s.sendall(dp._DELIMITER + bytes((dp._LONG,)) + struct.pack(">Q", 1000))
            conns.append(s)
        greeting = _connect(mgr.endpoint)  # the greeting itself, a byte at a time
        conns.append(greeting)
        t0 = time.monotonic()
        closed_at: dict[int, float] = {}
        while len(closed_at) < len(conns) and time.monotonic() - t0 < 15:
            for i, s in enumerate(conns):
                if i in closed_at:
                    continue
                try:
                    s.send(dp._GREETING[:1] if s is greeting else b"x")
                except OSError:
                    closed_at[i] = time.monotonic() - t0
            time.sleep(0.25)
        assert len(closed_at) == len(conns), f"{len(conns) - len(closed_at)} still open after 15 s"
        assert max(closed_at.values()) < 2 + 3, closed_at  # deadline, watchdog period, a send to notice
        assert mgr.metric("orbitkv_dataplane_message_timeouts_total") >= len(conns)
        RemoteClient(mgr.endpoint, timeout=10).ping()
    finally:
        for s in conns:
            s.close()
        assert mgr.stop() == 0, mgr.log


def test_messages_of_millions_of_block_ids_build_nothing(tmp_path):
    """Two connections each send a 58 MiB save of 60,000 chunks of 1,000 block ids in a registered engine's
    name, without its credential: each is answered Unauthenticated. Then the engine sends the same with its
    credential: a request error (its lists would build more than --data-plane-max-buffered). The manager's peak
    RSS grows by no more than the bytes of the messages it holds, and the engine is served. When the chunks
    were decoded before the credential was checked and counted, each such message was built (60 million list
    items, about 0.5 GB) and only then refused."""
    mgr = ManagerProcess(shm_dir=str(tmp_path), endpoint=f"ipc://{tmp_path}/dp.sock")
    pages, reg = _engine(str(tmp_path))
    conns: list[socket.socket] = []
    try:
        engine = RemoteClient(mgr.endpoint, timeout=60)
        info = engine.register(reg)
        eid, cred = info.engine_id, info.credential
        n = 60_000  # within the bound on chunks a request (MAX_ITEMS), each of 1,000 one-byte block ids
        chunks = b"\xdc" + n.to_bytes(2, "big") + (b"\x92\xc4\x10" + bytes(16) + b"\xdc\x03\xe8" + b"\x01" * 1000) * n
        body = b"\x94\xa4save" + msgspec.msgpack.encode(eid) + chunks + b"\xa0"
        base = mgr.rss("VmHWM")
        answers: list[dp.WireError] = []

        def attack(body: bytes = body) -> None:
            s = _handshaken(mgr.endpoint)
            conns.append(s)
            s.sendall(dp._DELIMITER + dp._frame(body))
            empty, reply = dp._read_message(s.makefile("rb"))
            answers.append(msgspec.msgpack.decode(reply[1:], type=dp.WireError))

        threads = [threading.Thread(target=attack) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [a.type for a in answers] == ["Unauthenticated"] * 2, answers
        attack(b"\x94\xa4save" + msgspec.msgpack.encode(eid) + chunks + msgspec.msgpack.encode(cred))
        assert answers[2].type == "RequestError" and "send fewer chunks" in answers[2].message, answers[2]
        grown = mgr.rss("VmHWM") - base
        assert grown < 2 * len(body) + 64 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"
        assert engine.lookup(eid, [bytes(16)], lease=False).count == 0
        assert mgr.metric("orbitkv_dataplane_auth_failures_total") == 2
        engine.close()
    finally:
        for s in conns:
            s.close()
        pages.close()
        assert mgr.stop() == 0, mgr.log
