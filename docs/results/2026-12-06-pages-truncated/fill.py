"""Another process fills the tmpfs under a Manager started with --no-reserve-pool: what happens to the Manager.

A 32 MiB tmpfs is mounted at MOUNT (needs root). One tree's ``orbitkv-cache-manager`` (PYTHONPATH=PKG, laid out
as for truncate.py) starts there with a 16 MiB pool it does not reserve (``--no-reserve-pool``: the free space is
checked at start, pages come with the first writes). An engine (``orbitkv-sample-engine``) saves one chunk;
then another process writes a file until the tmpfs is full; then the engine saves 16 chunks (new arena pages)
and restores them. Is the Manager alive, what did the engine see, and ``orbitkv_pool_private_bytes``.

Usage: python fill.py PKG OUT.json MOUNT"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request


def main() -> None:
    pkg, out_path, mnt = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.makedirs(mnt, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", mnt], check=True)
    env = dict(os.environ, PYTHONPATH=pkg)
    try:
        mgr = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "16mb",
                                "--no-reserve-pool", "--data-plane", "tcp://127.0.0.1:0", "--http-addr",
                                "127.0.0.1:0", "--shm-dir", mnt, "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        for line in mgr.stdout:
            lines.append(line)
            if "ready:" in line:
                break
        found = re.search(r"ready: data plane (\S+), http (http://[^\s,]+)", "".join(lines))
        dp, http = found.group(1), found.group(2)

        def engine(op: str, chunks: int) -> str:
            p = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.sample_engine", op, "--codec", "none",
                                "--data-plane", dp, "--shm-dir", mnt, "--chunks", str(chunks)], capture_output=True,
                               text=True, timeout=120, env=env)
            return ((p.stdout + p.stderr).strip().splitlines() or [""])[-1][:240] + f" (exit {p.returncode})"

        out: dict = {"pkg": pkg, "first_save": engine("save", 1)}
        filled = 0
        with open(os.path.join(mnt, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"x" * (1 << 20))
                    filled += 1
            except OSError as e:
                out["filler"] = f"{filled} MiB written, then {e.strerror}"
        out["save_after_fill"] = engine("save", 16)
        time.sleep(1)
        out["manager_alive"] = mgr.poll() is None
        out["manager_exit"] = mgr.poll()
        if mgr.poll() is None:
            out["restore"] = engine("restore", 16)
            with urllib.request.urlopen(http + "/metrics", timeout=10) as r:
                out["pool_private_bytes"] = [ln for ln in r.read().decode().splitlines()
                                             if ln.startswith("orbitkv_pool_private_bytes")]
            mgr.terminate()
            mgr.wait(30)
        out["manager_log_warnings"] = [ln[:240] for ln in mgr.stdout.read().splitlines() if "WARNING" in ln]
        json.dump(out, open(out_path, "w"), indent=1)
        print(json.dumps(out, indent=1))
    finally:
        subprocess.run(["umount", mnt])


if __name__ == "__main__":
    main()
