"""A local process holds connections to a Manager's peer port (peer sharing on, a secret set) and keeps each
talking: N TCP connections that complete the ZMTP handshake (greeting and READY, as a DEALER sends them), then send
a message frame without the secret's tag every 5 s, so the port's heartbeat (a connection silent for 30 s is
closed) never fires. Measured: the Manager's descriptors while they are held and 40 s in, ``/healthz``, an engine's
save, a real peer's request (a DEALER with the secret) answered, and the Manager's peer metrics.

Usage: PYTHONPATH=PKG python talkers.py N OUT.json [EXTRA_MANAGER_ARGS...]"""
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import zmq

from orbitkv_fs.peers import protocol as P

hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
work = tempfile.mkdtemp(dir="/dev/shm", prefix="pt-")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


http, peer, dp = free_port(), free_port(), f"tcp://127.0.0.1:{free_port()}"
secret = b"s" * 32
path = os.path.join(work, "secret")
open(path, "wb").write(secret)
os.chmod(path, 0o600)
log = open(os.path.join(work, "m.log"), "w")
m = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb",
                      "--http-addr", f"127.0.0.1:{http}", "--data-plane", dp, "--peer-port", str(peer),
                      "--peer-secret-file", path, "--shm-dir", work, "--log-level", "warning", *sys.argv[3:]],
                     stderr=log, cwd=work)


def get(p: str, t: float = 3) -> "int | str":
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{http}{p}", timeout=t).status
    except Exception as e:
        return type(e).__name__


def metrics() -> dict:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5).read().decode()
    except Exception as e:
        return {"error": type(e).__name__}
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("orbitkv_peer_served_connections") or ln.startswith("orbitkv_peer_served_refusals")}


def descriptors() -> int:
    return len(os.listdir(f"/proc/{m.pid}/fd"))


def real_peer(req_id: int) -> str:
    """A real peer (a DEALER with the secret) asks for a prefix of a namespace nobody serves: a sealed refusal
    comes back when the port still answers."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{peer}")
    try:
        d.send(P.seal(P.encode(P.PrefixRequest(req_id, b"n" * 16, [b"c" * 16], [(0, 1)])), secret, P.REQUEST))
        return type(P.decode_reply(P.unseal(d.recv(), secret, P.REPLY))).__name__
    except zmq.Again:
        return "no answer in 5 s"
    finally:
        d.close(0)


for _ in range(150):
    if get("/healthz", 0.5) == 200:
        break
    time.sleep(0.2)
out: dict = {"pkg": os.environ.get("PYTHONPATH"), "connections": int(sys.argv[1]), "manager_args": sys.argv[3:],
             "descriptors_before": descriptors()}
body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
greeting = (b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
            + b"\x04" + bytes([len(body)]) + body)
noise = b"\x00\x08" + b"untagged"  # one message frame, no secret's tag
socks: list = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", peer))
        s.sendall(greeting)  # the first frame follows once the handshake is done (talk()): libzmq closed
        # connections that sent it in the same segment as the greeting
        s.setblocking(False)
        socks.append(s)
    except OSError:
        s.close()
        break


def talk() -> int:
    """One frame on every connection still open; answers how many are."""
    alive = 0
    for s in socks:
        try:
            while s.recv(65536):  # drain PINGs and anything else
                pass
            continue  # b"": closed by the Manager
        except BlockingIOError:
            pass
        except OSError:
            continue
        try:
            s.send(noise)
            alive += 1
        except OSError:
            pass
    return alive


time.sleep(2)
out["held"] = {"opened": len(socks), "alive": talk(), "descriptors": descriptors(), "healthz": get("/healthz"),
               "real_peer": real_peer(1), "metrics": metrics()}
r = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.sample_engine", "save", "--codec", "none",
                    "--data-plane", dp, "--shm-dir", work], capture_output=True, text=True, timeout=60, cwd=work)
said = ((r.stdout + r.stderr).strip().splitlines() or [""])[-1][:200]
out["held"]["engine_save"] = {"rc": r.returncode, "said": said}
t0 = time.monotonic()
while time.monotonic() - t0 < 40:
    alive = talk()
    time.sleep(5)
out["after_40s"] = {"alive": alive, "descriptors": descriptors(), "healthz": get("/healthz"), "real_peer": real_peer(2),
                    "metrics": metrics()}
for s in socks:
    s.close()
m.terminate()
m.wait(30)
log.close()
out["manager_log_tail"] = open(os.path.join(work, "m.log")).read().splitlines()[-3:]
shutil.rmtree(work)
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(out))
