"""A real ``orbitkv-cache-manager`` process for the tests that attack it from other processes: started with
the given flags, its data plane and HTTP addresses read from its "ready" line, its log kept, its RSS
readable, stopped with SIGTERM (killed if it does not stop)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

_READY = re.compile(r"ready: data plane (\S+), http (http://[^\s,]+)")


class ManagerProcess:
    def __init__(self, *flags: str, shm_dir: str, endpoint: str = "tcp://127.0.0.1:0", pool: str = "8mb",
                 timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", pool, "--device", "cpu", "--data-plane",
             endpoint, "--http-addr", "127.0.0.1:0", "--shm-dir", shm_dir, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError("orbitkv-cache-manager did not start:\n" + self.log)
        m = _READY.search(self.log)
        assert m is not None, self.log
        self.endpoint, self.http = m.group(1), m.group(2)

    def _read(self) -> None:
        for line in self.proc.stdout:  # drained all along: a full pipe would stall the manager
            self.lines.append(line)
            if "ready:" in line:
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def rss(self, field: str = "VmRSS") -> int:
        """Resident bytes of the manager process now (``VmHWM``: the most it has held)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
        raise AssertionError(f"no {field}")

    def metric(self, name: str) -> float:
        """One unlabelled sample of ``/metrics``."""
        import urllib.request

        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} is not in /metrics")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.proc.returncode


#: The start of a program that attacks a Manager from another process, with no token: it registers an engine
#: "attacker" over a pages file of its own (``n`` blocks, 2 layers, four 4 KiB segments a block) in the shm
#: directory. Its arguments: the data plane, the shm directory, ``n``, then the attack's own (``args``).
ATTACKER_ENGINE = """
import sys, time
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, n, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-attacker")
reg = EngineRegistration(model="attacker", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id="attacker")
c = connect(dp, timeout=60)
c.register(reg)
"""


def run_python(program: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``program`` in a fresh interpreter (the repository root on its path); its stdout. Raises with
    its output when it fails."""
    p = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=os.getcwd())
    if p.returncode != 0:
        raise AssertionError(f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def sample_engine_round_trip(endpoint: str, shm_dir: str) -> None:
    """``orbitkv-sample-engine`` saves its four chunks over the data plane at ``endpoint`` and restores them
    byte for byte: a bystander engine still served after an attack."""
    for op in ("save", "restore"):
        out = run_python("import sys; from orbitkv_fs.tools.sample_engine import main; sys.exit(main(sys.argv[1:]))",
                         op, "--codec", "none", "--data-plane", endpoint, "--shm-dir", shm_dir)
        assert ("identical to what was saved" if op == "restore" else "saved 4 chunks") in out, out


def peer_closed(s) -> bool:
    """True when the other end closed socket ``s`` (after reading whatever it had sent before); False when
    it is open (``s``'s timeout, or non-blocking with nothing to read)."""
    try:
        while True:
            if not s.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, BlockingIOError):
        return False
