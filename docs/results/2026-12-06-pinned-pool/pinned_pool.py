"""A local process pins the whole pool with lookup leases on chunks of its own: what is left for other engines.

One tree's ``orbitkv-cache-manager`` (``python -m orbitkv_fs.server.cli`` with PYTHONPATH=PKG, a directory whose
``orbitkv_fs`` is the tree's, with ``server``, ``tools`` and ``gpu`` inside it as the install lays them out) runs
on its defaults but a 64 MiB pool. The attacker, a second process with no token, registers an engine over a pages
file of its own, then for ROUNDS rounds saves 2,048 chunks of 16 KiB (four 4 KiB segments) and looks them up in
runs of 64 (each lookup a lease, within the lease bounds), and holds every lease. Then a victim engine (this
process, its own pages) saves 1,024 chunks of random bytes (16 MiB), looks them up and restores them; meanwhile
a third engine's lookups of its four chunks are timed (a save holds the DRAM tier's lock while it reserves).
Recorded: the victim's save time, segments dropped, chunks found and restored exactly; the bystander's lookup
latency during the victim's save; the Manager's pinned chunks and pinned evictions.

Usage: python pinned_pool.py PKG OUT.json [ROUNDS]   (ROUNDS default 4: the pool passed twice)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ATTACKER = """
import sys
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-attacker")
reg = EngineRegistration(model="attacker", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id="attacker")
c = connect(dp, timeout=600)
c.register(reg)
leased = 0
for r in range(rounds):
    chunks = [ChunkBlocks(chunk_key(f"a{r}-{i}"), [i]) for i in range(n)]
    c.save("attacker", chunks)
    for j in range(0, n, 64):
        leased += c.lookup("attacker", [ch.key for ch in chunks[j:j + 64]]).lease_id != 0
print(leased, flush=True)
sys.stdin.readline()
"""

VICTIM = """
import json, sys, threading, time
import numpy as np
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm = sys.argv[1], sys.argv[2]

def engine(name, n):
    tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
               for l in range(2) for r in ("key", "value")]
    pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-{name}")
    reg = EngineRegistration(model=name, num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                             head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                             engine_kind="sample", engine_id=name)
    c = connect(dp, timeout=600)
    c.register(reg)
    return pages, c

n = 1024
pages, c = engine("victim", n)
rng = np.random.default_rng(7)
for name in pages.tensors:
    raw = pages.array(name).view(np.uint16)
    raw[...] = rng.integers(0, 1 << 16, size=raw.shape, dtype=np.uint16)
want = {name: pages.array(name).view(np.uint16).copy() for name in pages.tensors}
bpages, b = engine("bystander", 4)
bchunks = [ChunkBlocks(chunk_key(f"b{i}"), [i]) for i in range(4)]
b.save("bystander", bchunks)
lat, stop = [], threading.Event()

def look():
    while not stop.is_set():
        t0 = time.perf_counter()
        b.lookup("bystander", [ch.key for ch in bchunks], lease=False)
        lat.append(time.perf_counter() - t0)
        time.sleep(0.002)

chunks = [ChunkBlocks(chunk_key(f"v{i}"), [i]) for i in range(n)]
th = threading.Thread(target=look)
th.start()
t0 = time.perf_counter()
saved = c.save("victim", chunks)
took = time.perf_counter() - t0
stop.set()
th.join()
for name in pages.tensors:
    pages.array(name).view(np.uint16)[...] = 0
lk = c.lookup("victim", [ch.key for ch in chunks])
res = c.restore("victim", chunks, lease_id=lk.lease_id)
exact = sum(np.array_equal(pages.array(name).view(np.uint16), want[name]) for name in pages.tensors)
print(json.dumps({"victim_save_s": round(took, 4), "victim_chunks_saved": saved.chunks_saved,
                  "victim_segments_dropped": saved.dropped_segments, "victim_lookup_count": lk.count,
                  "victim_chunks_restored": sum(res.restored), "victim_tensors_exact": f"{exact} of 4",
                  "bystander_lookups_during_save": len(lat),
                  "bystander_lookup_ms_median": round(1e3 * sorted(lat)[len(lat) // 2], 3) if lat else None,
                  "bystander_lookup_ms_max": round(1e3 * max(lat), 3) if lat else None}))
"""


def start_manager(pkg: str, work: str) -> tuple[subprocess.Popen, list[str], str, str, dict]:
    """The tree's manager (a 64 MiB pool, shared memory in ``work``) once ready: the process, its output lines so far
    (a thread keeps reading), its data-plane endpoint, its HTTP address and the environment that runs the tree."""
    env = dict(os.environ, PYTHONPATH=pkg)
    mgr = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb", "--data-plane",
                            "tcp://127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--shm-dir", work, "--device", "cpu"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in mgr.stdout:
            lines.append(line)
            if "ready:" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(60)
    m = re.search(r"ready: data plane (\S+), http (http://[^\s,]+)", "".join(lines))
    return mgr, lines, m.group(1), m.group(2), env


def main() -> None:
    pkg, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    work = tempfile.mkdtemp(prefix="pinned-pool-", dir="/dev/shm")
    mgr, lines, dp, http, env = start_manager(pkg, work)

    def metrics() -> dict:
        with urllib.request.urlopen(http + "/metrics", timeout=60) as r:
            text = r.read().decode()
        names = ("orbitkv_pinned_chunks", "orbitkv_pinned_evictions_total", "orbitkv_leases_active",
                 "orbitkv_pool_used_bytes", "orbitkv_evictions_total", "orbitkv_dropped_segments_total")
        return {n: float(ln.split()[1]) for ln in text.splitlines() for n in names if ln.startswith(n + " ")}

    out: dict = {"pkg": pkg, "rounds": rounds}
    t0 = time.perf_counter()
    att = subprocess.Popen([sys.executable, "-c", ATTACKER, dp, work, "2048", str(rounds)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, cwd=work)
    out["attacker_leases"] = int(att.stdout.readline())
    out["attacker_seconds"] = round(time.perf_counter() - t0, 2)
    out["after_attack"] = metrics()
    p = subprocess.run([sys.executable, "-c", VICTIM, dp, work], capture_output=True, text=True, timeout=1800,
                       env=env, cwd=work)
    out["victim"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else (p.stdout + p.stderr)[-600:]
    out["after_victim"] = metrics()
    att.communicate("\n", timeout=60)
    mgr.terminate()
    mgr.wait(60)
    out["manager_log_warnings"] = [ln[:240] for ln in lines if "WARNING" in ln][:6]
    shutil.rmtree(work)
    json.dump(out, open(out_path, "w"), indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
