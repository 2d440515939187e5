"""The control plane under a process that wants to exhaust it: connections that never finish a request, that
trickle one, that never read their answer, and more of them than the Manager has descriptors for. A real
uvicorn on loopback (:class:`~orbitkv_fs.server.app.HttpServer`) over a real Manager, attacked with plain
sockets; the descriptor test floods a Manager process of its own, as a local attacker would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi import Response  # noqa: E402

from orbitkv_fs.manager import Manager, ManagerConfig  # noqa: E402
from orbitkv_fs.server.app import HttpServer, create_app  # noqa: E402
from orbitkv_fs.server.connections import HttpLimits  # noqa: E402

from metrics_text import m1, metrics  # noqa: E402
from polling import wait_until  # noqa: E402

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
ROOT = Path(__file__).resolve().parents[1]
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request's start, never its end


class Control:
    """A Manager's control plane on loopback with the given limits, two routes of the test's own (one that
    holds its answer until released, one with a 64 MiB answer), and an httpx client."""

    def __init__(self, limits: HttpLimits) -> None:
        self.manager = Manager(ManagerConfig(pool_size=4 << 20, shm_dir=SHM, device="cpu"))
        self.app = create_app(self.manager, address="127.0.0.1:0", http_limits=limits)
        self.release = threading.Event()
        self.holding: list[int] = []  # one entry per request inside /test/hold (appends are atomic)

        def hold() -> dict:
            self.holding.append(1)
            self.release.wait(30)
            return {"held": True}

        self.app.add_api_route("/test/hold", hold)
        self.app.add_api_route("/test/big", lambda: Response(b"x" * (64 << 20), media_type="application/octet-stream"))
        self.server = HttpServer(self.app, "127.0.0.1", 0).start()
        self.port = self.server.port
        self.http = httpx.Client(base_url=self.server.url, timeout=10)

    def stats(self):
        return self.app.state.http_guard.stats()

    def partial(self, data: bytes = PARTIAL) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        if data:
            s.sendall(data)
        return s

    def close(self) -> None:
        self.release.set()
        self.http.close()
        self.server.close()
        self.manager.close()


@pytest.fixture
def control(request):
    c = Control(request.param if hasattr(request, "param") else HttpLimits(max_connections=8, request_timeout_s=2.0))
    yield c
    c.close()


def status_of_answer(sock: socket.socket) -> int:
    """Read one whole HTTP answer from ``sock`` (its body by Content-Length) and return its status."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return int(head.split()[1])


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The server closed (or reset) ``sock`` within ``timeout``; data it sent before closing is skipped."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sock.recv(1 << 16) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def test_idle_and_unfinished_connections_make_room_for_new_ones(control):
    attackers = [control.partial(b"" if i % 2 else PARTIAL) for i in range(40)]
    assert wait_until(lambda: control.stats().connections_displaced_total >= 32)
    r = control.http.get("/healthz")
    assert r.status_code == 200
    s = control.stats()
    assert s.connections <= 8 and s.connections_refused_total == 0
    # The oldest went first: the first attackers are closed, the newest few still open.
    assert all(closed_by_server(a, 2) for a in attackers[:30])
    assert not closed_by_server(attackers[-1], 0.2)
    for a in attackers:
        a.close()


def test_a_connection_that_just_completed_a_request_is_displaced_after_older_idle_ones(control):
    keep = control.partial(b"")
    first = [control.partial() for _ in range(3)]
    assert wait_until(lambda: control.stats().connections == 4)  # all four admitted before keep's request
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status_of_answer(keep) == 200
    rest = [control.partial() for _ in range(5)]  # nine in all: one must go
    assert wait_until(lambda: control.stats().connections_displaced_total == 1)
    assert closed_by_server(first[0], 2)
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status_of_answer(keep) == 200
    for a in [keep, *first, *rest]:
        a.close()


def test_a_request_must_arrive_within_the_deadline_however_slowly_its_bytes_keep_coming(control):
    trickle = control.partial(b"G")
    started = time.monotonic()
    cut = None
    for byte in PARTIAL[1:] * 10:
        try:
            trickle.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            cut = time.monotonic() - started
            break
        time.sleep(0.05)
    assert cut is not None and 1.9 < cut < 5.0, cut
    idle = control.partial(b"")  # a connection that never sends a byte
    assert closed_by_server(idle, 5.0)
    assert control.stats().request_timeouts_total == 2
    # A request that arrives in full within the deadline is answered, and its connection lives on after it.
    slow = control.partial(b"GET /healthz HTTP/1.1\r\n")
    time.sleep(1.0)
    slow.sendall(b"Host: 127.0.0.1\r\n\r\n")
    assert status_of_answer(slow) == 200
    time.sleep(1.5)  # past the first request's deadline: answered requests are not timed
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status_of_answer(slow) == 200
    assert control.stats().request_timeouts_total == 2
    # The next request on that connection is timed from its first byte (uvicorn's keep-alive timer stops there).
    slow.sendall(PARTIAL)
    started = time.monotonic()
    assert closed_by_server(slow, 6.0) and time.monotonic() - started < 5.0
    assert control.stats().request_timeouts_total == 3
    slow.close()


def test_requests_being_answered_are_never_displaced_and_the_next_connection_is_told_busy(control):
    results: list = []

    def ask() -> None:
        with httpx.Client(base_url=control.server.url, timeout=30) as c:
            results.append(c.get("/test/hold").status_code)

    askers = [threading.Thread(target=ask) for _ in range(8)]
    for t in askers:
        t.start()
    assert wait_until(lambda: len(control.holding) == 8)
    time.sleep(2.5)  # past the request deadline: a request being answered is not timed out either
    late = control.partial(b"")
    answer = b""
    while chunk := late.recv(4096):
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
    assert json.loads(body)["code"] == "busy"
    s = control.stats()
    assert s.connections_refused_total == 1 and s.connections_displaced_total == 0 and s.request_timeouts_total == 0
    control.release.set()
    for t in askers:
        t.join(10)
    assert results == [200] * 8
    assert control.http.get("/healthz").status_code == 200


def test_an_answer_the_client_does_not_take_is_cut_off(control):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", control.port))
    s.sendall(b"GET /test/big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    time.sleep(1.0)  # the answer fills the socket; then a next request must not reset the answer's deadline
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert wait_until(lambda: control.stats().request_timeouts_total == 1, timeout=10)
    assert wait_until(lambda: control.stats().connections == 0)
    got = 0
    try:
        s.settimeout(2)
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    assert got < 64 << 20  # the answer was cut, not delivered late
    s.close()


def test_limits_are_in_the_config_and_the_metrics(control):
    attackers = [control.partial() for _ in range(12)]
    assert wait_until(lambda: control.stats().connections_displaced_total >= 4)
    for a in attackers:
        a.close()
    assert control.http.get("/v1/config").json()["http"]["max_connections"] == 8
    ms = metrics(control.http)
    assert m1(ms, "orbitkv_http_max_connections") == 8
    assert m1(ms, "orbitkv_http_request_timeout_seconds") == 2.0
    assert m1(ms, "orbitkv_http_connections_displaced_total") == control.stats().connections_displaced_total
    assert m1(ms, "orbitkv_http_connections") >= 1  # this scrape's own
    for name in ("orbitkv_http_connections_refused_total", "orbitkv_http_request_timeouts_total"):
        assert m1(ms, name) == 0, name


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError):
        HttpLimits(request_timeout_s=0)


FLOODED = textwrap.dedent("""
    import logging, resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from orbitkv_fs.manager import Manager, ManagerConfig
    from orbitkv_fs.server.app import HttpServer, create_app
    from orbitkv_fs.server.connections import HttpLimits
    m = Manager(ManagerConfig(pool_size=4 << 20, shm_dir=sys.argv[2], device="cpu"))
    app = create_app(m, address="127.0.0.1:0", http_limits=HttpLimits(max_connections=int(sys.argv[3])))
    s = HttpServer(app, "127.0.0.1", 0).start()
    print(s.port, flush=True)
    sys.stdin.readline()
    print(app.state.http_guard.stats().connections, flush=True)
    s.close()
""")


SUSTAINED = textwrap.dedent("""
    import collections, socket, sys, time
    held, end = collections.deque(), time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        s = socket.socket()
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", int(sys.argv[1])))
            s.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n")
            held.append(s)
        except OSError:
            s.close()
        if len(held) > 2000:
            held.popleft().close()
""")


def answered_during_a_sustained_flood(port: int) -> tuple[int, int, float]:
    """(answered 200, asked, seconds): ``/healthz`` asked 80 times, 50 ms apart, while another process connects
    without pause. A connection admitted in an accept burst must not be displaced by the rest of that burst
    before its request is read (an accept burst as large as the limit lost about one request in 25)."""
    flooder = subprocess.Popen([sys.executable, "-c", SUSTAINED, str(port), "6"])
    try:
        time.sleep(0.5)
        ok, started = 0, time.monotonic()
        for _ in range(80):
            try:
                ok += httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        seconds = time.monotonic() - started
    finally:
        flooder.wait(30)
    return ok, 80, seconds


@pytest.mark.parametrize("max_connections", [10_000, 64], ids=["over-the-descriptor-limit", "under-it"])
def test_a_flood_of_connections_leaves_the_manager_answering(max_connections, tmp_path):
    """A Manager process flooded with unfinished requests. With a connection limit above its descriptors
    (256), accepts fail (EMFILE): asyncio's report of each comes through once per ten seconds, not once per
    connection in the backlog with its traceback (that was 309 MB in a minute). With the descriptors the limit
    asks for (:attr:`HttpLimits.descriptors`, which the CLI sets), no accept fails, and a request from
    someone else is answered during the flood."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    under = max_connections < 256
    descriptors = HttpLimits(max_connections).descriptors + 64 if under else 256
    child = subprocess.Popen([sys.executable, "-c", FLOODED, str(descriptors), str(tmp_path), str(max_connections)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=tmp_path)
    socks = []
    try:
        port = int(child.stdout.readline())
        started = time.monotonic()
        for _ in range(3000 if under else 600):  # over: what the descriptors and the backlog hold
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(PARTIAL)
            socks.append(s)
        # Under the limit the connects go through at once (about a second): the kernel's queue is deeper than
        # asyncio's accept burst. As shallow as the burst, it fills and drops SYNs, a second per retry: 150 s.
        assert not under or time.monotonic() - started < 30
        time.sleep(1.0)
        if under:
            r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            assert r.status_code == 200
            ok, asked, seconds = answered_during_a_sustained_flood(port)
            # 4-5 s when connects go through at once; a full kernel queue drops SYNs (a second per retry): 80+ s
            assert ok == asked and seconds < 30, (ok, asked, seconds)
        child.stdin.write("\n")
        child.stdin.flush()
        open_now = int(child.stdout.readline())
        assert open_now <= max_connections
    finally:
        for s in socks:
            s.close()
        child.stdin.close()
        child.wait(30)
        err = child.stderr.read()
    accept_lines = [ln for ln in err.splitlines() if "socket.accept() out of system resource" in ln]
    tracebacks = err.count("Traceback")
    if under:
        assert accept_lines == [] and tracebacks == 0, err[-2000:]
    else:
        assert 1 <= len(accept_lines) <= 2 and tracebacks == 0, err[-2000:]
