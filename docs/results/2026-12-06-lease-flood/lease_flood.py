"""A local process that registers an engine of its own and holds leases: what the Manager's memory does.

Anyone who can reach the data plane may register an engine over pages it owns, and an engine's ``lookup``
leases the run it finds until a restore or release ends it, or ``--lease-ttl`` (300 s) passes. One tree's
``orbitkv-cache-manager`` (``python -m orbitkv_fs.server.cli`` with PYTHONPATH=PKG, a directory whose
``orbitkv_fs`` is the tree's, with ``server`` and ``tools`` inside it as the install lays them out) runs on its
defaults but a 256 MiB pool. The attacker, a second process with no token, creates a pages file in the shm
directory, registers an engine over it, saves CHUNKS chunks of one block, and then for SECONDS looks up all of
them again and again, taking a lease each time and releasing none. Every second: the Manager's resident memory
(``/proc/PID/status`` VmRSS), the attacker's lookups so far, and ``orbitkv_leases_active``,
``orbitkv_leased_bytes`` and, where the tree has them, ``orbitkv_pinned_chunks`` and
``orbitkv_leases_displaced_total`` (before 9c1cb3d ``orbitkv_leases_active`` counted each pinned chunk of each
lease). Then, with the attacker still registered: a second engine's save and restore over the data plane
(``orbitkv-sample-engine``), and ``/healthz``. The Manager's memory is also capped (``RLIMIT_AS`` is no use with
its mappings): when it passes MAX_RSS_MIB the run stops and says so, as the OOM killer would.

Usage: python lease_flood.py PKG OUT.json [SECONDS [CHUNKS [MAX_RSS_MIB]]]  (60, 1024, 6144)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
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
            return {"status": r.status, "seconds": round(time.perf_counter() - t0, 3), "body": r.read().decode()}
    except Exception as e:  # the figure is what the client saw
        return {"status": f"{type(e).__name__}: {str(e)[:80]}", "seconds": round(time.perf_counter() - t0, 3)}


def rss_mib(pid: int) -> int:
    for ln in open(f"/proc/{pid}/status"):
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) >> 10
    return -1


def metric(text: str, name: str) -> float | None:
    for ln in text.splitlines():
        if ln.startswith(name + " ") or ln.startswith(name + "{"):
            return float(ln.split()[-1])
    return None


ATTACKER = """
import sys, time
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, seconds, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-attacker")
reg = EngineRegistration(model="attacker", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id="attacker")
c = connect(dp, timeout=30)
c.register(reg)
chunks = [ChunkBlocks(chunk_key(f"a{i}"), [i]) for i in range(n)]
c.save("attacker", chunks)
keys = [ch.key for ch in chunks]
print("ready", flush=True)
calls = leased = 0
end = next_report = time.monotonic()
end += seconds
try:
    while time.monotonic() < end:
        lk = c.lookup("attacker", keys)
        calls += 1
        leased += lk.lease_id != 0
        if time.monotonic() >= next_report:
            print(calls, leased, flush=True)
            next_report += 1.0
except Exception as e:
    print("attacker stopped:", type(e).__name__, str(e)[:120], flush=True)
print(calls, leased, flush=True)
time.sleep(3600)
"""


def main() -> None:
    pkg, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    chunks = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
    max_rss = int(sys.argv[5]) if len(sys.argv) > 5 else 6144
    work = tempfile.mkdtemp(prefix="lease-flood-", dir="/dev/shm")
    port, dp = free_port(), f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=pkg)
    log = open(os.path.join(work, "manager.log"), "w")
    mgr = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "256mb",
                            "--http-addr", f"127.0.0.1:{port}", "--data-plane", dp, "--log-level", "warning",
                            "--shm-dir", work], stderr=log, env=env, cwd=work)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while get(base + "/healthz", 0.5)["status"] != 200:
        assert time.monotonic() < deadline and mgr.poll() is None, "the Manager did not start"
        time.sleep(0.2)
    out: dict = {"pkg": pkg, "seconds": seconds, "chunks_per_lookup": chunks, "rss_cap_mib": max_rss,
                 "rss_idle_mib": rss_mib(mgr.pid)}
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, dp, work, str(seconds), str(chunks)], env=env,
                                cwd=work, stdout=subprocess.PIPE, text=True)
    assert attacker.stdout.readline().strip() == "ready", "the attacker did not start"
    said: list[str] = []  # the attacker's running count: lookups, lookups that took a lease
    threading.Thread(target=lambda: said.extend(iter(attacker.stdout.readline, "")), daemon=True).start()
    samples = []
    t0 = time.monotonic()
    capped = False
    while time.monotonic() - t0 < seconds + 1:
        time.sleep(1.0)
        m = get(base + "/metrics", 10.0)
        body = m.get("body", "")
        counts = said[-1].split() if said else ["0", "0"]
        samples.append({"t": round(time.monotonic() - t0, 1), "rss_mib": rss_mib(mgr.pid),
                        "attacker_lookups": int(counts[0]), "attacker_leases": int(counts[1]),
                        "leases_active": metric(body, "orbitkv_leases_active"),
                        "pinned_chunks": metric(body, "orbitkv_pinned_chunks"),
                        "leases_displaced_total": metric(body, "orbitkv_leases_displaced_total"),
                        "leased_bytes": metric(body, "orbitkv_leased_bytes"), "metrics_seconds": m["seconds"]})
        if samples[-1]["rss_mib"] > max_rss:
            capped = True
            break
    attacker.kill()
    attacker.wait(30)
    out["attacker_said"] = [ln.strip() for ln in said[-2:]]
    out["samples"] = samples
    out["rss_cap_reached"] = capped
    out["rss_mib_per_second"] = round((samples[-1]["rss_mib"] - samples[0]["rss_mib"]) /
                                      max(samples[-1]["t"] - samples[0]["t"], 1e-9), 1)
    t = time.perf_counter()
    r = [subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.sample_engine", op, "--codec", "none",
                         "--data-plane", dp, "--shm-dir", work], capture_output=True, text=True, timeout=120,
                        env=env, cwd=work) for op in ("save", "restore")]
    out["engine"] = [{"rc": x.returncode, "said": ((x.stdout + x.stderr).strip().splitlines()[-1:] or [""])[0][:200]}
                     for x in r]
    out["engine_seconds"] = round(time.perf_counter() - t, 2)
    out["healthz_after"] = {k: v for k, v in get(base + "/healthz").items() if k != "body"}
    out["rss_end_mib"] = rss_mib(mgr.pid)
    mgr.terminate()
    try:
        out["manager_exit"] = mgr.wait(60)
    except subprocess.TimeoutExpired:
        mgr.kill()
        out["manager_exit"] = "killed after 60 s"
    log.close()
    lines = open(os.path.join(work, "manager.log"), errors="replace").read().splitlines()
    out["manager_log"] = {"lines": len(lines), "last": [ln[:200] for ln in lines[-3:]]}
    shutil.rmtree(work)
    json.dump(out, open(out_path, "w"), indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
    for s in samples[:: max(1, len(samples) // 10)]:
        print(s)


if __name__ == "__main__":
    main()
