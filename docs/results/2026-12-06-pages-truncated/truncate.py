"""A local process shrinks its own pages file under the Manager's mapping: what happens to the Manager.

One tree's ``orbitkv-cache-manager`` (``python -m orbitkv_fs.server.cli`` with PYTHONPATH=PKG, a directory whose
``orbitkv_fs`` is the tree's, with ``server``, ``tools`` and ``gpu`` inside it as the install lays them out) runs
on its defaults but a 64 MiB pool. First a bystander engine (``orbitkv-sample-engine``) saves four chunks. Then
the attacker, a second process with no token, creates a pages file in the shm directory, registers an engine
over it, saves eight chunks, truncates the file to its first page (``os.truncate``: its own file, any user may),
and saves again (MODE ``save``: the Manager reads past the new end) or restores (MODE ``restore``: it writes
past it). Then: is the Manager alive (its exit status if not), what did the attacker's call answer, and can the
bystander still restore its chunks and save new ones.

Usage: python truncate.py PKG OUT.json [MODE]   (MODE: save or restore; default save)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ATTACKER = """
import os, sys, time
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, mode = sys.argv[1], sys.argv[2], sys.argv[3]
tensors = [PageTensor(f"L{l}.{r}", 0, [64, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
path = f"{shm}/orbitkv-pages-attacker"
pages = HostPages.create(tensors, path=path)
reg = EngineRegistration(model="attacker", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id="attacker")
c = connect(dp, timeout=10)
c.register(reg)
chunks = [ChunkBlocks(chunk_key(f"a{i}"), [i]) for i in range(8)]
c.save("attacker", chunks)
os.truncate(path, 4096)
t0 = time.perf_counter()
try:
    r = c.restore("attacker", chunks) if mode == "restore" else c.save("attacker", [ChunkBlocks(chunk_key("b"), [40])])
    print("answered", type(r).__name__)
except Exception as e:
    print("raised", type(e).__name__, str(e)[:240])
print("seconds", round(time.perf_counter() - t0, 3))
"""


def main() -> None:
    pkg, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "save"
    work = tempfile.mkdtemp(prefix="pages-truncated-", dir="/dev/shm")
    env = dict(os.environ, PYTHONPATH=pkg)
    mgr = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb", "--data-plane",
                            "tcp://127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--shm-dir", work, "--device", "cpu"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
    lines = []
    for line in mgr.stdout:
        lines.append(line)
        if "ready:" in line:
            break
    dp = re.search(r"ready: data plane (\S+),", "".join(lines)).group(1)

    def run(*args: str) -> str:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=work)
        return ((p.stdout + p.stderr).strip().splitlines() or [""])[-1][:240] + f" (exit {p.returncode})"

    def bystander(op: str) -> str:
        return run("-m", "orbitkv_fs.tools.sample_engine", op, "--codec", "none", "--data-plane", dp, "--shm-dir",
                   work, "--engine-id", "bystander-tp0")

    out: dict = {"pkg": pkg, "mode": mode, "bystander_save": bystander("save")}
    p = subprocess.run([sys.executable, "-c", ATTACKER, dp, work, mode], capture_output=True, text=True, timeout=120,
                       env=env, cwd=work)
    out["attacker"] = (p.stdout + p.stderr).strip().splitlines()[-2:]
    time.sleep(1)
    out["manager_alive"] = mgr.poll() is None
    out["manager_exit"] = mgr.poll()
    out["bystander_restore"] = bystander("restore")
    out["bystander_save_again"] = run("-m", "orbitkv_fs.tools.sample_engine", "save", "--codec", "none",
                                      "--data-plane", dp, "--shm-dir", work, "--engine-id", "bystander-tp0",
                                      "--chunks", "8")
    if mgr.poll() is None:
        mgr.terminate()
        try:
            mgr.wait(30)
        except subprocess.TimeoutExpired:
            mgr.kill()
    rest = mgr.stdout.read()
    out["manager_log_tail"] = [ln[:240] for ln in ("".join(lines) + rest).splitlines()[-3:]]
    shutil.rmtree(work)
    json.dump(out, open(out_path, "w"), indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
