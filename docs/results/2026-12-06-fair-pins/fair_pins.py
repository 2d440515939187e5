"""An engine looks up its chunks, then another local process pins far more than the pins' share: does the engine's
restore still find its chunks?

One tree's ``orbitkv-cache-manager`` (``python -m orbitkv_fs.server.cli`` with PYTHONPATH=PKG, laid out as in
../2026-12-06-pinned-pool/pinned_pool.py) runs on its defaults but a 64 MiB pool (pins' share 0.5: 32 MiB). The
victim, a process of its own, saves N chunks of random bytes (16 KiB each: four 4 KiB segments), looks them all
up (one lease) and waits. The attacker, a second process with no token, then saves 2,048 chunks of its own
ROUNDS times and looks each round up in runs of 64 (``../2026-12-06-pinned-pool``'s attacker: its pins far over
the share), and holds every lease. Then the victim restores under its lease. Recorded: the victim's chunks
restored and whether its pages are exactly what it saved, the attacker's time, the pinned evictions.

Usage: python fair_pins.py PKG OUT.json [N] [ROUNDS]   (N 256, ROUNDS 4)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-06-pinned-pool"))
from pinned_pool import ATTACKER, start_manager  # noqa: E402  (the same attacker and manager)

VICTIM = """
import json, sys
import numpy as np
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-victim")
rng = np.random.default_rng(7)
for name in pages.tensors:
    raw = pages.array(name).view(np.uint16)
    raw[...] = rng.integers(0, 1 << 16, size=raw.shape, dtype=np.uint16)
want = {name: pages.array(name).view(np.uint16).copy() for name in pages.tensors}
reg = EngineRegistration(model="victim", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id="victim")
c = connect(dp, timeout=600)
c.register(reg)
chunks = [ChunkBlocks(chunk_key(f"v{i}"), [i]) for i in range(n)]
saved = c.save("victim", chunks)
lk = c.lookup("victim", [ch.key for ch in chunks])
print(json.dumps({"saved": saved.chunks_saved, "found": lk.count}), flush=True)
sys.stdin.readline()  # the attacker has pinned its rounds
for name in pages.tensors:
    pages.array(name).view(np.uint16)[...] = 0
res = c.restore("victim", chunks, lease_id=lk.lease_id)
exact = sum(np.array_equal(pages.array(name).view(np.uint16), want[name]) for name in pages.tensors)
print(json.dumps({"restored": sum(res.restored), "tensors_exact": f"{exact} of 4",
                  "misses": sorted({m.reason for m in res.misses})}), flush=True)
"""


def main() -> None:
    pkg, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    work = tempfile.mkdtemp(prefix="fair-pins-", dir="/dev/shm")
    mgr, _, dp, http, env = start_manager(pkg, work)

    def metric(name: str) -> float:
        with urllib.request.urlopen(http + "/metrics", timeout=60) as r:
            return next(float(ln.split()[1]) for ln in r.read().decode().splitlines() if ln.startswith(name + " "))

    out: dict = {"pkg": pkg, "victim_chunks": n, "rounds": rounds}
    vic = subprocess.Popen([sys.executable, "-c", VICTIM, dp, work, str(n)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, cwd=work)
    out["victim_before_attack"] = json.loads(vic.stdout.readline())
    t0 = time.perf_counter()
    att = subprocess.Popen([sys.executable, "-c", ATTACKER, dp, work, "2048", str(rounds)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, cwd=work)
    out["attacker_leases"] = int(att.stdout.readline())
    out["attacker_seconds"] = round(time.perf_counter() - t0, 2)
    out["pinned_evictions_total"] = metric("orbitkv_pinned_evictions_total")
    out["pinned_chunks"] = metric("orbitkv_pinned_chunks")
    vic.stdin.write("\n")
    vic.stdin.flush()
    out["victim_restore"] = json.loads(vic.stdout.readline())
    vic.wait(60)
    att.communicate("\n", timeout=60)
    mgr.terminate()
    mgr.wait(60)
    shutil.rmtree(work)
    json.dump(out, open(out_path, "w"), indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
