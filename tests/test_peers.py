"""Peer sharing over real Transfer Engines and real shared-memory arenas in separate processes.

The serving Managers here are ``orbitkv_fs.tools.bench_peer serve`` processes: a real /dev/shm arena
holding CRC-valid segments, a real PeerServer and Transfer Engine. The requester is this process with its
own arena and PeerNode. Faults (a corrupted segment, a peer that dies right after granting a lease) are
injected through that server's command line; nothing else is faked.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.peers import FailureReason, PeerConfig, PeerError, PeerNode, UnknownPeer, transport_available
from orbitkv_fs.peers import protocol as P
from orbitkv_fs.segment import Role
from orbitkv_fs.tools.bench_peer import ShmArena, make_segments, start_server, stop_server

pytestmark = pytest.mark.skipif(not transport_available(), reason="mooncake Transfer Engine not importable")

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))


@pytest.fixture
def servers():
    procs = []

    def start(segments, extra=()):
        proc, hello = start_server(NS, segments, extra=extra)
        procs.append(proc)
        return proc, hello

    yield start
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_server(p)
        for path in glob.glob(f"/dev/shm/orbitkv-peer-arena-{p.pid}-*"):  # a killed server's arena stays
            os.unlink(path)


@pytest.fixture
def requester():
    nodes = []

    def make(peers, namespaces=(NS,), **cfg):
        arena = ShmArena(1 << 20, list(namespaces))
        # Budget 5 s unless a test is about the budget: a loaded 2-core CI host connects slowly.
        node = PeerNode(arena, peers=peers, config=PeerConfig(**{"staging_bytes": 64 << 20, "budget_s": 5.0, **cfg}))
        nodes.append((node, arena))
        return node, arena

    yield make
    for node, arena in nodes:
        node.close()
        arena.close()


def test_core_imports_without_mooncake_or_zmq():
    code = ("import sys, orbitkv_fs, orbitkv_fs.peers, orbitkv_fs.segment;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('mooncake','zmq','fastapi')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_saved_on_a_restores_on_b_byte_exact(servers, requester):
    _, a = servers(["24:65536:1", "3:4194304:2"])
    node, arena = requester([a["address"]])
    assert arena.fetcher is node.client
    segs = make_segments(NS, 24, 65536, 1) + make_segments(NS, 3, 4194304, 2)
    got = node.client.fetch([k for k, _ in segs])
    assert len(got) == len(segs)
    for k, b in segs:
        assert got[k] == b
    st = node.stats()
    assert st.keys_fetched_total == len(segs)
    assert st.fetched_bytes_total == sum(len(b) for _, b in segs)
    assert st.failures_total == {}
    assert st.staging_used_bytes == 0 and st.abandoned_reads == 0
    assert st.hit_latency.count == 1 and sum(st.hit_latency.buckets) == 1 and st.hit_latency.sum > 0
    assert st.peers[0].session_id == a["session_id"] and st.peers[0].state == "ok"


def test_three_managers_fan_out_and_partial_hits(servers, requester):
    _, a = servers(["8:65536:1"])
    _, c = servers(["8:65536:3"])
    node, _ = requester([a["address"], c["address"]])
    from_a = make_segments(NS, 8, 65536, 1)
    from_c = make_segments(NS, 8, 65536, 3)
    absent = make_segments(NS, 2, 65536, 99)
    keys = [k for k, _ in from_a + absent + from_c]
    got = node.client.fetch(keys)
    assert set(got) == {k for k, _ in from_a + from_c}
    assert all(got[k] == b for k, b in from_a + from_c)
    st = node.stats()
    assert st.misses_total == 2
    per_peer = {p.address: p.keys_fetched_total for p in st.peers}
    assert per_peer == {a["address"]: 8, c["address"]: 8}
    assert st.failures_total == {}


def test_peer_killed_mid_transfer_is_a_miss_within_budget(servers, requester):
    # A grants the lease, then SIGKILLs itself 20 ms later while ~64 MiB of reads are in flight.
    a_proc, a = servers(["16:4194304:5"], extra=["--die-after-lease-ms", "20"])
    _, c = servers(["4:65536:6"])
    node, _ = requester([a["address"], c["address"]], budget_s=2.0)
    big = [k for k, _ in make_segments(NS, 16, 4194304, 5)]
    t = time.monotonic()
    got = node.client.fetch(big)
    elapsed = time.monotonic() - t
    assert a_proc.wait(10) == -signal.SIGKILL
    assert elapsed < 2.0 + 0.5
    assert len(got) < len(big)  # what arrived before the kill verified; the rest is a miss
    st = node.stats()
    assert st.misses_total == len(big) - len(got)
    assert sum(st.failures_total.get(r, 0) for r in (FailureReason.TRANSFER, FailureReason.TIMEOUT)) >= 1
    a_info = next(p for p in st.peers if p.address == a["address"])
    assert a_info.state == "backoff"
    # B keeps serving: the surviving peer still answers, and A (in backoff) is not asked.
    small = make_segments(NS, 4, 65536, 6)
    got = node.client.fetch([k for k, _ in small])
    assert all(got[k] == b for k, b in small)
    deadline = time.monotonic() + 40
    while node.client.abandoned_reads and time.monotonic() < deadline:
        node.client.fetch([])
        time.sleep(0.05)
    assert node.stats().staging_used_bytes == 0


def test_stalled_peer_read_is_parked_until_the_engine_gives_it_up(servers, requester):
    # A freezes (SIGSTOP) 10 ms after granting the lease, with 32 MiB of reads in flight.
    a_proc, a = servers(["8:4194304:7"], extra=["--stop-after-lease-ms", "10"])
    node, _ = requester([a["address"]], budget_s=0.5)
    keys = [k for k, _ in make_segments(NS, 8, 4194304, 7)]
    t = time.monotonic()
    got = node.client.fetch(keys)
    assert time.monotonic() - t < 1.0
    assert len(got) < len(keys)
    st = node.stats()
    assert st.failures_total == {FailureReason.TIMEOUT: 1}
    # The reads the fetch gave up on still own their staging memory.
    assert st.abandoned_reads >= 1 and st.staging_used_bytes >= 4194304
    assert node.client.fetch([]) == {} and node.stats().abandoned_reads == st.abandoned_reads
    os.kill(a_proc.pid, signal.SIGKILL)  # the engine sees the reset and fails what was in flight
    deadline = time.monotonic() + 40
    while node.client.abandoned_reads and time.monotonic() < deadline:
        node.client.fetch([])
        time.sleep(0.05)
    st = node.stats()
    assert st.abandoned_reads == 0 and st.staging_used_bytes == 0


def test_corrupted_bytes_are_caught_by_crc(servers, requester):
    _, a = servers(["6:65536:8"], extra=["--corrupt", "2"])
    node, _ = requester([a["address"]])
    segs = make_segments(NS, 6, 65536, 8)
    got = node.client.fetch([k for k, _ in segs])
    assert set(got) == {k for i, (k, _) in enumerate(segs) if i != 2}
    assert all(got[k] == b for k, b in segs if k in got)
    st = node.stats()
    assert st.failures_total == {FailureReason.CHECKSUM: 1}
    assert st.peers[0].state == "backoff" and st.peers[0].failures_total == {FailureReason.CHECKSUM: 1}
    # Backed off: the next fetch does not ask it.
    assert node.client.fetch([segs[0][0]]) == {}
    assert node.stats().peers[0].requests_total == 1


def test_namespace_mismatch_refused_by_the_peer(servers, requester):
    _, a = servers(["2:65536:9"])
    node, _ = requester([a["address"]], namespaces=(OTHER_NS,))
    key = ObjectKey(OTHER_NS, make_segments(NS, 1, 65536, 9)[0][0].chunk, 0, Role.KEY)
    assert node.client.fetch([key]) == {}
    assert node.stats().failures_total == {FailureReason.NAMESPACE: 1}


@pytest.mark.parametrize("answer, reason", [
    ("other_namespace", FailureReason.NAMESPACE),
    ("huge_extent", FailureReason.PROTOCOL),
    ("extent_count", FailureReason.PROTOCOL),
    ("garbage", FailureReason.PROTOCOL),
    ("refused_busy", FailureReason.REFUSED),
    ("other_host_session", FailureReason.PROTOCOL),  # would turn this Manager's reads on a third host
])
def test_bad_answers_are_refused_by_the_requester(requester, answer, reason):
    """A misbehaving peer (a raw ROUTER socket here) never gets a read submitted, only a failure."""
    import threading

    import zmq

    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    node, _ = requester([f"127.0.0.1:{port}"], budget_s=2.0)
    key = make_segments(NS, 1, 65536, 10)[0][0]
    sess = node.transport.session_id

    def reply(req):
        return {
            "other_namespace": P.encode(P.LeaseReply(req.req_id, OTHER_NS, sess, 4096, 1, [P.Extent(0, 128, 1)])),
            "huge_extent": P.encode(P.LeaseReply(req.req_id, NS, sess, 4096, 1, [P.Extent(0, 1 << 40, 1)])),
            "extent_count": P.encode(P.LeaseReply(req.req_id, NS, sess, 4096, 1, [])),
            "garbage": b"\xc1\xc1",
            "refused_busy": P.encode(P.Refused(req.req_id, P.RefuseReason.BUSY)),
            "other_host_session": P.encode(P.LeaseReply(req.req_id, NS, "192.0.2.1:15000", 4096, 1,
                                                        [P.Extent(0, 128, 1)])),
        }[answer]

    def serve():
        ident, frame = rogue.recv_multipart()
        rogue.send_multipart([ident, reply(P.decode_request(frame))])

    th = threading.Thread(target=serve)
    th.start()
    assert node.client.fetch([key]) == {}
    th.join()
    rogue.close(0)
    st = node.stats()
    assert st.failures_total == {reason: 1} and st.staging_used_bytes == 0
    assert st.peers[0].state == "backoff"


def test_leases_of_a_requester_that_never_releases_expire():
    import zmq

    from orbitkv_fs.peers import PeerServer

    arena = ShmArena(1 << 20, [NS])
    key, seg = make_segments(NS, 1, 65536, 16)[0]
    arena.put(key, seg)
    server = PeerServer(arena, "127.0.0.1:1", lease_ttl_s=0.5)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"tcp://{server.address}")
    try:
        s.send(P.encode(P.LeaseRequest(1, NS, [key.pack()])))
        rep = P.decode_reply(s.recv())
        assert isinstance(rep, P.LeaseReply) and rep.lease_id and arena.leases_active == 1
        deadline = time.monotonic() + 5
        while arena.leases_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert arena.leases_active == 0 and server.counters.leases_expired == 1 and server.leases_active == 0
        s.send(P.encode(P.ReleaseRequest(2, rep.lease_id)))  # a late release of an expired lease: harmless
        assert P.decode_reply(s.recv()) == P.Ack(2)
        assert server.counters.releases == 0
    finally:
        s.close(0)
        server.close()
        arena.close()


@pytest.mark.parametrize("frame, side", [
    (b"\x84\xa4type\xa5lease\xa6req_id\x01\xa9namespace\xc4\x10" + bytes(16) + b"\xa4keys\xdc\x40\x01"
     + b"\xc4\x00" * (P.MAX_KEYS + 1), "request"),
    (b"\x85\xa4type\xa6prefix\xa6req_id\x01\xa9namespace\xc4\x10" + bytes(16) + b"\xa6chunks\xdc\x40\x01"
     + b"\xc4\x00" * (P.MAX_KEYS + 1) + b"\xa6layers\x90", "request"),
    (b"\x85\xa4type\xa6prefix\xa6req_id\x01\xa9namespace\xc4\x10" + bytes(16) + b"\xa6chunks\x90\xa6layers"
     + b"\xdd" + (4 * P.MAX_KEYS + 1).to_bytes(4, "big") + b"\x92\x00\x00" * (4 * P.MAX_KEYS + 1), "request"),
    (b"\x87\xa4type\xa6leased\xa6req_id\x01\xa9namespace\xc4\x10" + bytes(16) + b"\xaasession_id\xa0"
     + b"\xacbase_address\x00\xa8lease_id\x01\xa7extents\xdc\x40\x01" + b"\xc0" * (P.MAX_KEYS + 1), "reply"),
])
def test_a_frames_lists_are_bounded_before_they_are_built(frame, side):
    """Keys, chunks, layers and extents over the protocol's bounds are refused from the lists' headers (the
    schema's length check, not the count after the decode): a frame of a million empty items builds nothing."""
    decode = P.decode_request if side == "request" else P.decode_reply
    with pytest.raises(P.ProtocolError, match="Expected `array` of length <= "):
        decode(frame)


def test_server_survives_garbage_and_answers_typed_refusals(servers):
    import zmq

    _, a = servers(["1:65536:11"])
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"tcp://{a['address']}")
    s.send(b"\xc1 not msgpack")
    s.send(msgspec.msgpack.encode({"type": "lease", "req_id": 7, "namespace": b"short", "keys": []}))
    rep = P.decode_reply(s.recv())
    assert isinstance(rep, P.Refused) and rep.req_id == 7 and rep.reason == P.RefuseReason.BAD_REQUEST
    s.send(P.encode(P.LeaseRequest(8, NS, [b"\x00" * 35])))
    rep = P.decode_reply(s.recv())
    assert isinstance(rep, P.Refused) and rep.req_id == 8
    key = make_segments(NS, 1, 65536, 11)[0][0]
    s.send(P.encode(P.LeaseRequest(9, NS, [ObjectKey(OTHER_NS, key.chunk, 0, Role.KEY).pack()])))
    rep = P.decode_reply(s.recv())
    assert isinstance(rep, P.Refused) and rep.reason == P.RefuseReason.NAMESPACE
    s.send(P.encode(P.LeaseRequest(10, NS, [key.pack()])))
    rep = P.decode_reply(s.recv())
    assert isinstance(rep, P.LeaseReply) and rep.lease_id and rep.extents[0] is not None
    s.send(P.encode(P.ReleaseRequest(11, rep.lease_id)))
    assert P.decode_reply(s.recv()) == P.Ack(11)
    s.send(P.encode(P.PrefixRequest(12, NS, [key.chunk, b"\x01" * 16], [(0, int(Role.KEY))])))
    assert P.decode_reply(s.recv()) == P.PrefixReply(12, NS, 1)
    s.close(0)


def test_lookup_prefix_and_registry(servers, requester):
    _, a = servers(["4:65536:12"])
    node, _ = requester([])
    segs = make_segments(NS, 4, 65536, 12)
    assert node.client.lookup_prefix(NS, [segs[0][0].chunk], [(0, int(Role.KEY))]) == 0  # no peers
    info = node.client.add_peer(a["address"])
    assert info.static is False and info.state == "ok"
    with pytest.raises(PeerError):
        node.client.add_peer(a["address"])
    with pytest.raises(PeerError):
        node.client.add_peer("no-port")
    # make_segments alternates K (even) and V (odd) at layer 0: only even chunks hold a K segment.
    chunks = [k.chunk for k, _ in segs]
    assert node.client.lookup_prefix(NS, chunks, [(0, int(Role.KEY))]) == 1
    assert node.client.lookup_prefix(NS, [chunks[0], chunks[2], chunks[1]], [(0, int(Role.KEY))]) == 2
    node.client.remove_peer(a["address"])
    with pytest.raises(UnknownPeer):
        node.client.remove_peer(a["address"])
    assert node.client.peers() == []


def test_unreachable_peer_backs_off(requester):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node, _ = requester([f"127.0.0.1:{port}"], budget_s=0.2, backoff_base_s=0.3)
    key = make_segments(NS, 1, 65536, 13)[0][0]
    t = time.monotonic()
    assert node.client.fetch([key]) == {}
    assert time.monotonic() - t < 0.5
    st = node.stats()
    assert st.failures_total == {FailureReason.TIMEOUT: 1} and st.peers[0].state == "backoff"
    assert node.client.fetch([key]) == {}  # skipped, not asked
    assert node.stats().peers[0].requests_total == 1
    time.sleep(0.35)
    node.client.fetch([key])
    st = node.stats()
    assert st.peers[0].requests_total == 2 and st.peers[0].consecutive_failures == 2


def test_fetch_into_a_manager_arena(servers):
    """Reads land straight in a real Manager's arena (reserve, verify in place, publish); a corrupt segment
    is refused and its reservation returned."""
    from orbitkv_fs.manager import Manager, ManagerConfig

    _, a = servers(["6:65536:14", "2:4194304:15"], extra=["--corrupt", "1"])
    m = Manager(ManagerConfig(pool_size=32 << 20, device="cpu"))
    node = PeerNode(m, peers=[a["address"]], config=PeerConfig(staging_bytes=1 << 20, budget_s=5.0))
    try:
        segs = make_segments(NS, 6, 65536, 14) + make_segments(NS, 2, 4194304, 15)
        published = node.client.fetch_into(m, [k for k, _ in segs])
        assert set(published) == {k for i, (k, _) in enumerate(segs) if i != 1}
        for i, (k, b) in enumerate(segs):
            assert m.read_object(k) == (None if i == 1 else b)
        st = node.stats()
        assert st.failures_total == {FailureReason.CHECKSUM: 1} and st.keys_fetched_total == 7
        ms = m.stats()
        assert ms.reserved_bytes == 0 and ms.leases_active == 0
    finally:
        node.close()
        m.close()


def test_concurrent_fetches(servers, requester):
    """The Manager fetches from several worker threads at once: pooled sockets, one staging allocator."""
    from concurrent.futures import ThreadPoolExecutor

    _, a = servers(["32:65536:17", "4:1048576:18"])
    node, _ = requester([a["address"]], budget_s=10.0)
    segs = make_segments(NS, 32, 65536, 17) + make_segments(NS, 4, 1048576, 18)
    parts = [segs[i::6] for i in range(6)]

    def run(part):
        got = node.client.fetch([k for k, _ in part])
        return all(got.get(k) == b for k, b in part)

    with ThreadPoolExecutor(6) as ex:
        assert all(ex.map(run, parts * 3))
    st = node.stats()
    assert st.keys_fetched_total == 3 * len(segs) and st.failures_total == {}
    assert st.staging_used_bytes == 0 and st.abandoned_reads == 0


SECRET = b"peer-secret-for-the-tests-0123456789"


def test_peer_requests_without_the_secret_are_never_answered_nor_acted_on():
    """With a peer secret, a request must carry its tag: one without it (or under another secret) is
    counted and dropped -- no lease, no reply; a frame over the size bound is dropped by the socket; a
    tagged request is served, and its reply is tagged too."""
    import zmq

    from orbitkv_fs.peers import PeerServer

    arena = ShmArena(1 << 20, [NS])
    try:
        key, seg = make_segments(NS, 1, 65536, 21)[0]
        arena.put(key, seg)
        server = PeerServer(arena, "127.0.0.1:1", secret=SECRET)
    except BaseException:
        arena.close()
        raise
    ctx = zmq.Context.instance()

    def dealer():
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 1000)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://{server.address}")
        return d

    s = dealer()
    try:
        req = P.encode(P.LeaseRequest(1, NS, [key.pack()]))
        for frame in (req, P.seal(req, b"another-secret-0123456789abcdef", P.REQUEST),
                      P.seal(req, SECRET, P.REPLY)):  # a reply's tag does not make a request
            s.send(frame)
            with pytest.raises(zmq.Again):
                s.recv()
        assert server.counters.refused[P.RefuseReason.UNAUTHENTICATED] == 3 and arena.leases_active == 0
        big = dealer()
        big.send(P.seal(b"\x00" * (P.MAX_FRAME_BYTES + 1), SECRET, P.REQUEST))
        with pytest.raises(zmq.Again):
            big.recv()
        big.close(0)
        s.send(P.seal(req, SECRET, P.REQUEST))
        raw = s.recv()
        with pytest.raises(P.ProtocolError):
            P.decode_reply(raw)  # the tag follows the body
        rep = P.decode_reply(P.unseal(raw, SECRET, P.REPLY))
        assert isinstance(rep, P.LeaseReply) and rep.lease_id and arena.leases_active == 1
        s.send(P.seal(P.encode(P.ReleaseRequest(2, rep.lease_id)), SECRET, P.REQUEST))
        assert P.decode_reply(P.unseal(s.recv(), SECRET, P.REPLY)) == P.Ack(2)
        assert arena.leases_active == 0
    finally:
        s.close(0)
        server.close()
        arena.close()


def test_a_requester_with_a_secret_takes_only_tagged_replies(requester):
    """A reply without the tag (a peer without the secret, or anything else answering on its port) is a
    protocol failure, not a read; a tagged one is taken."""
    import threading

    import zmq

    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    node, _ = requester([f"127.0.0.1:{port}"], budget_s=2.0)
    node.client._secret = SECRET  # as PeerNode(secret=...) sets it
    key = make_segments(NS, 1, 65536, 22)[0][0]
    seen = []

    def serve(tag: bool):
        ident, frame = rogue.recv_multipart()
        req = P.decode_request(P.unseal(frame, SECRET, P.REQUEST))  # the request came tagged
        seen.append(req)
        body = P.encode(P.Refused(req.req_id, P.RefuseReason.BUSY))
        rogue.send_multipart([ident, P.seal(body, SECRET, P.REPLY) if tag else body])

    for tag, reason in ((False, FailureReason.PROTOCOL), (True, FailureReason.REFUSED)):
        th = threading.Thread(target=serve, args=(tag,))
        th.start()
        node.client._peers[f"127.0.0.1:{port}"].backoff_until = 0.0
        assert node.client.fetch([key]) == {}
        th.join()
        assert node.stats().failures_total.get(reason) == 1, node.stats().failures_total
    assert len(seen) == 2
    rogue.close(0)


def test_a_public_peer_port_needs_a_secret(tmp_path, monkeypatch):
    import argparse

    from orbitkv_fs.access import InsecureBind
    from orbitkv_fs.peers.node import add_peer_arguments, peer_secret, start_from_args

    parser = argparse.ArgumentParser()
    add_peer_arguments(parser)
    monkeypatch.delenv("ORBITKV_PEER_SECRET", raising=False)
    args = parser.parse_args(["--peer-port", "9300", "--peer-host", "192.0.2.7"])
    with pytest.raises(InsecureBind, match="without a peer secret"):
        start_from_args(object(), args)  # refused before anything starts
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert peer_secret(parser.parse_args(["--peer-secret-file", str(path)])) == SECRET
    monkeypatch.setenv("ORBITKV_PEER_SECRET", "short")
    with pytest.raises(InsecureBind):
        peer_secret(args)


_READY = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
#: a ZMTP 3.0 greeting (NULL mechanism) and READY, as a DEALER sends them
_GREETING = (b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31)
             + b"\x04" + bytes([len(_READY)]) + _READY)


def test_a_connection_that_never_talks_is_closed_and_a_quiet_peer_is_not(monkeypatch):
    """The peer port's heartbeat: a process that completes the ZMTP handshake and then holds the connection
    without a word (3,000 such connections held 3,000 of a Manager's descriptors for good) is closed at the
    heartbeat timeout; a real peer's socket answers the PINGs by itself and survives a long quiet spell."""
    import socket

    import zmq

    from orbitkv_fs.peers import PeerServer
    from orbitkv_fs.peers import server as peer_server

    monkeypatch.setattr(peer_server, "HEARTBEAT_IVL_MS", 200)
    monkeypatch.setattr(peer_server, "HEARTBEAT_TIMEOUT_MS", 600)
    arena = ShmArena(1 << 20, [NS])
    key, seg = make_segments(NS, 1, 65536, 16)[0]
    arena.put(key, seg)
    server = PeerServer(arena, "127.0.0.1:1")
    host, port = server.address.rsplit(":", 1)
    mute = socket.create_connection((host, int(port)), timeout=5)
    mute.sendall(_GREETING)
    quiet = zmq.Context.instance().socket(zmq.DEALER)
    quiet.setsockopt(zmq.RCVTIMEO, 5000)
    quiet.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped, it would stay dropped (not hide it by reconnecting)
    quiet.connect(f"tcp://{server.address}")
    try:
        quiet.send(P.encode(P.PrefixRequest(1, NS, [key.chunk], [(0, int(Role.KEY))])))
        assert P.decode_reply(quiet.recv()) == P.PrefixReply(1, NS, 1)
        closed, deadline = False, time.monotonic() + 5
        while not closed and time.monotonic() < deadline:
            try:
                closed = mute.recv(4096) == b""  # its PINGs, then the close
            except ConnectionResetError:
                closed = True
        assert closed, "a connection that never answered a PING is still open"
        time.sleep(1.0)  # past the timeout again: the real peer's socket answered every PING
        quiet.send(P.encode(P.PrefixRequest(2, NS, [key.chunk], [(0, int(Role.KEY))])))
        assert P.decode_reply(quiet.recv()) == P.PrefixReply(2, NS, 1)
    finally:
        mute.close()
        quiet.close(0)
        server.close()
        arena.close()


def _closed(s) -> bool:
    """Whether the Manager ended raw connection ``s`` (non-blocking): EOF or a reset after its PINGs."""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _talk_until_shed(server, talkers: list, host: str, port: int, source: str) -> None:
    """Open 30 raw connections from ``source`` to ``server``'s port (appended to ``talkers``) and keep each
    talking without the secret's tag, every 0.2 s, until the port (cap 8) has shut 23 of its connections, or 10 s."""
    import socket

    for _ in range(30):
        s = socket.socket()
        s.settimeout(5)
        s.bind((source, 0))
        s.connect((host, port))
        s.sendall(_GREETING)
        s.setblocking(False)
        talkers.append(s)
    start = time.monotonic()
    while time.monotonic() - start < 10:
        time.sleep(0.2)
        for s in talkers:
            if not _closed(s):
                try:
                    s.send(b"\x00\x08untagged")  # a message frame without the secret's tag
                except OSError:
                    pass
        if time.monotonic() - start > 2 and server.connections_closed >= 23 and server.connections <= 8:
            break


def test_talking_connections_past_the_cap_are_shut_and_real_peers_kept(monkeypatch):
    """A process that keeps talking on connections to the peer port, without the secret (each a frame every
    0.2 s, so the heartbeat never closes them), held as many of the Manager's descriptors as it opened (3,000 in
    docs/results/2026-12-06-peer-talkers). Past ``max_connections`` the port now shuts down connections that never
    carried a valid request (here all from one address, oldest first): the talkers go, a peer whose request was valid keeps its connection (its
    DEALER does not reconnect, so a drop would show), and a peer that connects after the flood is answered."""
    import zmq

    from orbitkv_fs.peers import PeerServer

    arena = ShmArena(1 << 20, [NS])
    key, seg = make_segments(NS, 1, 65536, 16)[0]
    arena.put(key, seg)
    server = PeerServer(arena, "127.0.0.1:1", secret=SECRET, max_connections=8)
    host, port = server.address.rsplit(":", 1)
    ask = P.PrefixRequest(1, NS, [key.chunk], [(0, int(Role.KEY))])

    def dealer():
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 5000)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RECONNECT_IVL, -1)
        d.connect(f"tcp://{server.address}")
        return d

    def answered(d, req_id: int) -> bool:
        d.send(P.seal(P.encode(msgspec.structs.replace(ask, req_id=req_id)), SECRET, P.REQUEST))
        try:
            return P.decode_reply(P.unseal(d.recv(), SECRET, P.REPLY)) == P.PrefixReply(req_id, NS, 1)
        except zmq.Again:
            return False

    early = dealer()
    talkers = []
    try:
        assert answered(early, 1)
        _talk_until_shed(server, talkers, host, int(port), "127.0.0.1")
        assert server.connections_closed >= 23, server.connections_closed  # 31 opened, at most 8 kept
        assert server.connections <= 8
        open_talkers = sum(not _closed(s) for s in talkers)
        assert open_talkers <= 7, open_talkers  # the early peer holds one of the 8
        assert server.counters.refused[P.RefuseReason.UNAUTHENTICATED] >= 20  # the kept talkers did talk
        assert answered(early, 2), "the peer whose request was valid lost its connection"
        late = dealer()
        try:
            assert answered(late, 3)
        finally:
            late.close(0)
    finally:
        for s in talkers:
            s.close()
        early.close(0)
        server.close()
        arena.close()


def test_a_flood_from_one_address_sheds_its_own_connections_not_a_new_peers():
    """Talkers from one address (127.0.0.2) flood the port after a peer from another has connected but not yet
    asked anything. Shutting the oldest never-valid connection would take the peer's (it came first); past the
    cap the port sheds the flooding address's own connections, so the peer's DEALER, which does not reconnect,
    is answered when it asks."""
    import zmq

    from orbitkv_fs.peers import PeerServer

    arena = ShmArena(1 << 20, [NS])
    key, seg = make_segments(NS, 1, 65536, 16)[0]
    arena.put(key, seg)
    server = PeerServer(arena, "127.0.0.1:1", secret=SECRET, max_connections=8)
    host, port = server.address.rsplit(":", 1)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    for opt, value in ((zmq.RCVTIMEO, 5000), (zmq.SNDTIMEO, 5000), (zmq.LINGER, 0), (zmq.RECONNECT_IVL, -1)):
        peer.setsockopt(opt, value)  # SNDTIMEO: a DEALER whose connection was shut would block its send for good
    talkers = []
    try:
        peer.connect(f"tcp://{server.address}")
        deadline = time.monotonic() + 5
        while server.connections < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections == 1
        _talk_until_shed(server, talkers, host, int(port), "127.0.0.2")
        assert server.connections_closed >= 23 and server.connections <= 8
        assert sum(not _closed(s) for s in talkers) <= 7  # the peer holds one of the 8
        try:
            peer.send(P.seal(P.encode(P.PrefixRequest(1, NS, [key.chunk], [(0, int(Role.KEY))])), SECRET, P.REQUEST))
            got = P.decode_reply(P.unseal(peer.recv(), SECRET, P.REPLY))
        except zmq.Again:
            got = None
        assert got == P.PrefixReply(1, NS, 1), "the flood took the new peer's connection"
    finally:
        for s in talkers:
            s.close()
        peer.close(0)
        server.close()
        arena.close()


def test_a_connection_is_shut_only_while_its_descriptor_holds_it():
    """The cap shuts connections by descriptor number, which libzmq may have closed and the process reused by
    the time the monitor's event is read: ``_shut`` acts only when the descriptor still holds the same TCP
    connection (both ends), never closes the descriptor itself (libzmq owns it), and ``_Connections`` tracks only
    connections to its port. A libzmq that no longer tells a frame's source descriptor gives -1 (nothing marked
    valid), not an error in the serving loop."""
    import os
    import socket

    import zmq

    from orbitkv_fs.peers.server import _Connections, _ends, _shut, _source_fd

    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    a = socket.create_connection(("127.0.0.1", port))
    b, _ = lst.accept()
    other = socket.create_connection(("127.0.0.1", port))
    other_b, _ = lst.accept()
    try:
        ends = _ends(b.fileno())
        assert ends == (b.getsockname(), b.getpeername())
        assert not _shut(b.fileno(), _ends(other_b.fileno()))  # the number now holds another connection
        b.sendall(b"x")
        assert a.recv(1) == b"x"
        assert _shut(b.fileno(), ends)
        a.settimeout(5)
        assert a.recv(1) == b""  # shut down: the far end sees it end
        os.fstat(b.fileno())  # and the descriptor is still open, for libzmq to close
        r, w = os.pipe()
        try:
            assert _ends(r) is None and not _shut(r, ends)  # not a socket
        finally:
            os.close(r)
            os.close(w)
        conns = _Connections(1, port)
        conns.accepted(a.fileno())  # a connection *from* the port: another socket's number by now
        assert conns.open == {}
        conns.accepted(other_b.fileno())
        conns.accepted(b.fileno())
        conns.valid(other_b.fileno())
        conns.enforce()  # over the cap: the one that never carried a valid request goes, though newer
        assert list(conns.open) == [other_b.fileno()] and conns.closed_total == 1

        c1, c2 = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
        s1, s2 = lst.accept()[0], lst.accept()[0]
        try:
            both = _Connections(1, port)
            both.accepted(s1.fileno())
            both.accepted(s2.fileno())
            both.valid(s1.fileno())
            both.valid(s2.fileno())
            both.enforce()  # every one valid: the newest goes
            assert list(both.open) == [s1.fileno()]
            c2.settimeout(5)
            assert c2.recv(1) == b""
        finally:
            for x in (c1, c2, s1, s2):
                x.close()

        # Past the cap, the never-valid connection that goes is the oldest of the address holding the most.
        ends = []
        for src in ("127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.2", "127.0.0.3"):
            c = socket.socket()
            c.bind((src, 0))
            c.connect(("127.0.0.1", port))
            ends.append((c, lst.accept()[0]))
        try:
            by = _Connections(4, port)
            for _, srv in ends:
                by.accepted(srv.fileno())
            fds = [srv.fileno() for _, srv in ends]
            assert {a: list(m) for a, m in by.pending.items()} == {"127.0.0.2": [fds[0], fds[3]],
                                                                   "127.0.0.3": [fds[1], fds[2], fds[4]]}
            assert by.by_count == {2: {"127.0.0.2": None}, 3: {"127.0.0.3": None}}
            by.enforce()  # .3 holds three: its oldest goes, though .2's is older
            assert list(by.open) == [fds[0], fds[2], fds[3], fds[4]]
            assert list(by.by_count) == [2] and list(by.by_count[2]) == ["127.0.0.2", "127.0.0.3"]  # .3 came down
            by.cap = 3
            by.valid(fds[0])
            by.enforce()  # a valid one does not count: .3 holds two never-valid, .2 one
            assert list(by.open) == [fds[0], fds[3], fds[4]] and by.closed_total == 2
            by.gone(fds[3])
            by.valid(fds[4])
            assert by.pending == {} and by.by_count == {} and list(by.open) == [fds[0], fds[4]]
        finally:
            for c, srv in ends:
                c.close()
                srv.close()

        class _NoSrcFd:  # a libzmq that no longer tells a frame's source descriptor
            def get(self, option):
                raise zmq.ZMQError(22)

        assert _source_fd(_NoSrcFd()) == -1
    finally:
        for s in (a, b, other, other_b, lst):
            s.close()
