"""A local process churns connections to a peer port as fast as it can (connect, ZMTP greeting and READY, one
frame without the secret's tag, close; two threads) while a real peer (a DEALER with the secret) asks for a prefix
every 10 ms: the peer's round trips, and the connections the attacker completed. The cap's bookkeeping is Python
per accepted connection (the monitor's event, both TCP ends read, a shutdown past the cap), where libzmq alone
took them before; this measures what that costs the peers a port serves. In process, a `PeerServer` over a shared-
memory arena (`orbitkv_fs.tools.bench_peer.ShmArena`), cap 64. Each churned connection closes itself within
moments, so the cap is rarely passed and its shutdowns may not run (`closed_by_cap` 0 in churn.json): talkers.py
measures those.

Usage: PYTHONPATH=PKG python churn.py SECONDS OUT.json"""
import inspect
import json
import socket
import statistics
import sys
import threading
import time

import zmq

from orbitkv_fs.peers import PeerServer
from orbitkv_fs.peers import protocol as P
from orbitkv_fs.segment import Role
from orbitkv_fs.tools.bench_peer import ShmArena, make_segments

SECRET = b"s" * 32
NS = bytes(range(16))
seconds = float(sys.argv[1])
arena = ShmArena(1 << 20, [NS])
key, seg = make_segments(NS, 1, 65536, 16)[0]
arena.put(key, seg)
capped = "max_connections" in inspect.signature(PeerServer).parameters
server = PeerServer(arena, "127.0.0.1:1", secret=SECRET, **({"max_connections": 64} if capped else {}))
host, port = server.address.rsplit(":", 1)
body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
greeting = (b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
            + b"\x04" + bytes([len(body)]) + body)
stop = threading.Event()
made = [0, 0]


def churn(i: int) -> None:
    while not stop.is_set():
        try:
            s = socket.create_connection((host, int(port)), timeout=2)
            s.sendall(greeting)
            s.recv(64)  # the server's greeting: the handshake got that far
            s.sendall(b"\x00\x08untagged")
            s.close()
            made[i] += 1
        except OSError:
            pass


def ask(d, req_id: int) -> float:
    t = time.perf_counter()
    d.send(P.seal(P.encode(P.PrefixRequest(req_id, NS, [key.chunk], [(0, int(Role.KEY))])), SECRET, P.REQUEST))
    assert P.decode_reply(P.unseal(d.recv(), SECRET, P.REPLY)) == P.PrefixReply(req_id, NS, 1)
    return (time.perf_counter() - t) * 1e3


d = zmq.Context.instance().socket(zmq.DEALER)
d.setsockopt(zmq.RCVTIMEO, 5000)
d.setsockopt(zmq.LINGER, 0)
d.connect(f"tcp://{server.address}")
quiet = [ask(d, i) for i in range(1, 201)]
threads = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
loaded, req, end = [], 1000, time.monotonic() + seconds
while time.monotonic() < end:
    loaded.append(ask(d, req))
    req += 1
    time.sleep(0.01)
stop.set()
for t in threads:
    t.join()


def pct(xs: list, q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


out = {"capped": capped, "seconds": seconds, "connections_churned": sum(made),
       "connections_per_s": sum(made) / seconds,
       "quiet_ms": {"p50": statistics.median(quiet), "p99": pct(quiet, 0.99)},
       "during_churn_ms": {"n": len(loaded), "p50": statistics.median(loaded), "p99": pct(loaded, 0.99),
                           "max": max(loaded)},
       "closed_by_cap": getattr(server, "connections_closed", None)}
d.close(0)
server.close()
arena.close()
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(out))
