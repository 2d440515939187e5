"""A flood from one address against a peer that has just connected from another. A Manager runs with peer sharing
on, a secret set and ``--peer-max-connections CAP``. A real peer (a DEALER holding the secret, which does not
reconnect) connects from 127.0.0.1 and has not asked anything yet; then N raw connections from ADDRS other loopback
addresses (127.0.0.2, ...) complete the ZMTP handshake and send a frame without the secret's tag every second. After
10 s the peer asks for a prefix: answered (a sealed reply), or not (its connection was shut for the cap).

Usage: PYTHONPATH=PKG python sources.py N ADDRS CAP OUT.json"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import zmq

from orbitkv_fs.peers import protocol as P

n, addrs, cap, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
work = tempfile.mkdtemp(dir="/dev/shm", prefix="ps-")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


http, port = free_port(), free_port()
secret = b"s" * 32
path = os.path.join(work, "secret")
open(path, "wb").write(secret)
os.chmod(path, 0o600)
m = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb", "--http-addr",
                      f"127.0.0.1:{http}", "--data-plane", f"tcp://127.0.0.1:{free_port()}", "--peer-port", str(port),
                      "--peer-secret-file", path, "--peer-max-connections", str(cap), "--shm-dir", work,
                      "--log-level", "warning"], stderr=subprocess.DEVNULL, cwd=work)


def metrics() -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5).read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("orbitkv_peer_served_connections")}


def asked(d, req_id: int) -> str:
    try:  # a DEALER whose connection is gone (and that does not reconnect) cannot send at all
        d.send(P.seal(P.encode(P.PrefixRequest(req_id, b"n" * 16, [b"c" * 16], [(0, 1)])), secret, P.REQUEST))
        return type(P.decode_reply(P.unseal(d.recv(), secret, P.REPLY))).__name__
    except zmq.Again:
        return "no answer in 5 s (its connection was shut)"


try:
    for _ in range(150):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz", timeout=0.5)
            break
        except OSError:
            time.sleep(0.2)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    for opt, v in ((zmq.RCVTIMEO, 5000), (zmq.SNDTIMEO, 5000), (zmq.LINGER, 0), (zmq.RECONNECT_IVL, -1)):
        peer.setsockopt(opt, v)
    peer.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    greeting = (b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 48 + b"\x04" + bytes([len(body)]) + body)
    socks = []
    for i in range(n):
        s = socket.socket()
        s.settimeout(2)
        s.bind((f"127.0.0.{2 + i % addrs}", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(greeting)
        s.setblocking(False)
        socks.append(s)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        time.sleep(1)
        for s in socks:
            try:
                while s.recv(65536):
                    pass
            except BlockingIOError:
                try:
                    s.send(b"\x00\x08untagged")
                except OSError:
                    pass
            except OSError:
                pass
    out = {"pkg": os.environ.get("PYTHONPATH"), "talkers": n, "addresses": addrs, "cap": cap,
           "first_peer": asked(peer, 1), "metrics": metrics()}
    late = zmq.Context.instance().socket(zmq.DEALER)
    late.setsockopt(zmq.RCVTIMEO, 5000)
    late.setsockopt(zmq.LINGER, 0)
    late.connect(f"tcp://127.0.0.1:{port}")
    out["late_peer"] = asked(late, 2)
    for s in socks:
        s.close()
    peer.close(0)
    late.close(0)
finally:  # a run cut short leaves no Manager and no folder in /dev/shm
    m.terminate()
    m.wait(30)
    shutil.rmtree(work, ignore_errors=True)
json.dump(out, open(out_path, "w"), indent=1)
print(json.dumps(out))
