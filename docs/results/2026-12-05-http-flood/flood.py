"""A local process floods the Manager's HTTP port with idle connections: what the engines and the operator see.

One tree's ``orbitkv-cache-manager`` (``python -m orbitkv_fs.server.cli`` with PYTHONPATH=PKG, a directory whose
``orbitkv_fs`` is the tree's, with ``server`` and ``tools`` inside it as the install lays them out) runs on its
defaults but a 64 MiB pool, with the descriptor limit a systemd service gets (soft 1,024; the Manager lifts it
toward the hard one as it starts). The flooder, a second process with no credential and no token, opens N TCP
connections to the HTTP port and sends each the start of a request and nothing more (slowloris). While they
are open, and again after 35 s:

* ``GET /healthz`` from a third client, timed (3 s timeout);
* ``orbitkv-sample-engine save``: an engine registering and saving over the data plane;
* descriptors open in the Manager, and how many of the flooder's connections the Manager has closed;
* lines the Manager logged.

Then the flooder closes everything and ``/healthz`` is asked once more. Last, a sustained flood: a flooder
process connects without pause for 10 s (each connection sends a request's start; it keeps its newest 3,000 and
closes older ones) while ``/healthz`` is asked every 50 ms (3 s timeout) and, 2 s in, an engine saves; the
answers' statuses and latencies, and the Manager's descriptors at the end.

Usage: python flood.py PKG OUT.json [N]   (N defaults to 3000)"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 3.0) -> dict:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return {"status": r.status, "seconds": round(time.perf_counter() - t0, 3)}
    except Exception as e:  # the figure is what the client saw
        return {"status": f"{type(e).__name__}: {str(e)[:80]}", "seconds": round(time.perf_counter() - t0, 3)}


def closed_by_server(socks: list[socket.socket]) -> int:
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            n += s.recv(1 << 16) == b""
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


FLOODER = """
import collections, socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
held, made, failed = collections.deque(), 0, 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n")
        held.append(s)
        made += 1
    except OSError:
        failed += 1
        s.close()
    if len(held) > 3000:
        held.popleft().close()
print(made, failed)
"""


def sustained(base: str, port: int, engine_save, fds) -> dict:
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(port), "10"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    asked = []
    save = None
    t_save, t_end = time.monotonic() + 2.0, time.monotonic() + 9.0
    while time.monotonic() < t_end:
        asked.append(get(base + "/healthz", 3.0))
        if save is None and time.monotonic() > t_save:
            save = engine_save()
        time.sleep(0.05)
    made, failed = (int(x) for x in flooder.communicate(timeout=60)[0].split())
    ok = sorted(a["seconds"] for a in asked if a["status"] == 200)
    return {"flooder_connections": made, "flooder_connect_failures": failed,
            "healthz_asked": len(asked), "healthz_ok": len(ok),
            "healthz_failures": sorted({str(a["status"]) for a in asked if a["status"] != 200}),
            "healthz_ok_p50_s": round(statistics.median(ok), 4) if ok else None,
            "healthz_ok_max_s": max(ok) if ok else None, "engine_save": save, "descriptors_after": fds()}


def main() -> None:
    pkg, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
    work = tempfile.mkdtemp(prefix="flood-", dir="/dev/shm")
    port, dp = free_port(), f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=pkg)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    log = open(os.path.join(work, "manager.log"), "w")
    mgr = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb",
                            "--http-addr", f"127.0.0.1:{port}", "--data-plane", dp, "--log-level", "warning",
                            "--shm-dir", work], stderr=log, env=env, cwd=work,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while get(base + "/healthz", 0.5)["status"] != 200:
        assert time.monotonic() < deadline and mgr.poll() is None, "the Manager did not start"
        time.sleep(0.2)
    limit = int([ln for ln in open(f"/proc/{mgr.pid}/limits") if ln.startswith("Max open files")][0].split()[3])
    fds = lambda: len(os.listdir(f"/proc/{mgr.pid}/fd"))  # noqa: E731
    out: dict = {"pkg": pkg, "connections": n, "manager_descriptor_limit": limit, "descriptors_idle": fds()}

    def engine_save() -> dict:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.sample_engine", "save", "--codec", "none",
                            "--data-plane", dp, "--shm-dir", work], capture_output=True, text=True, timeout=120,
                           env=env, cwd=work)
        last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
        return {"rc": r.returncode, "seconds": round(time.perf_counter() - t0, 2), "said": last[0][:200]}

    socks, refused = [], 0
    t0 = time.perf_counter()
    for _ in range(n):
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            refused += 1
            s.close()
    out["flood"] = {"opened": len(socks), "refused": refused, "seconds": round(time.perf_counter() - t0, 2)}
    time.sleep(1)
    out["during"] = {"descriptors": fds(), "healthz": get(base + "/healthz"), "engine_save": engine_save(),
                     "closed_by_manager": closed_by_server(socks)}
    time.sleep(35)
    out["after_35s"] = {"descriptors": fds(), "healthz": get(base + "/healthz"),
                        "closed_by_manager": closed_by_server(socks)}
    for s in socks:
        s.close()
    time.sleep(1)
    out["flood_gone"] = {"healthz": get(base + "/healthz"), "descriptors": fds()}
    out["sustained_10s"] = sustained(base, port, engine_save, fds)
    metrics = get(base + "/metrics")
    if metrics["status"] == 200:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            out["metrics_http"] = {ln.split()[0]: float(ln.split()[1]) for ln in r.read().decode().splitlines()
                                   if ln.startswith("orbitkv_http_")}
    mgr.terminate()
    try:
        out["manager_exit"] = mgr.wait(30)
    except subprocess.TimeoutExpired:
        mgr.kill()
        out["manager_exit"] = "killed after 30 s"
    log.close()
    lines = open(os.path.join(work, "manager.log"), errors="replace").read().splitlines()
    out["manager_log"] = {"lines": len(lines), "bytes": os.path.getsize(os.path.join(work, "manager.log")),
                          "first": [ln[:200] for ln in lines[:3]]}
    shutil.rmtree(work)  # the arena, the sample engine's pages and the Manager's log (300 MB before)
    json.dump(out, open(out_path, "w"), indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
