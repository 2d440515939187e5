"""What registrations cost the Manager, and how many one OS user gets: one user registers ``--engines``
engines of ``--layers`` layers (K and V: two tensors a layer, each engine its own pages file in /dev/shm),
as a connection from another process would (a ``Caller`` of this user). Prints, per engine, the Manager
process's RSS growth, the time a registration took and the memory maps it added, and how many were refused
(``TooManyEngines``: the per-user quota; the tree on ``PYTHONPATH`` decides whether there is one).

``--file-per-layer``: each layer of an engine in a pages file of its own (the Manager maps each file it
registers: one memory map a file, and a process has at most ``vm.max_map_count``, 65,530 by default).

Usage: python registration_cost.py --layers 4096 --engines 8 [--file-per-layer]"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from orbitkv_fs.access import Caller
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.pages import host_engine_pages


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--file-per-layer", action="store_true")
    a = ap.parse_args()
    shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    files = []
    engines = []
    for _ in range(a.engines):
        parts = [host_engine_pages(num_layers=1 if a.file_per_layer else a.layers, layer_start=i, num_blocks=2,
                                   block_size=16, num_heads=1, head_dim=64, directory=shm)
                 for i in (range(a.layers) if a.file_per_layer else [0])]
        files += [p for p, _ in parts]
        engines.append([d for _, ds in parts for d in ds])
    try:
        with Manager(ManagerConfig(pool_size=8 << 20, device="cpu", shm_dir=shm)) as m:
            rss, maps, fds, t = _rss(), _maps(), _fds(), time.perf_counter()
            ok = refused = 0
            for descs in engines:
                reg = EngineRegistration(model="m", num_layers=a.layers, layer_start=0, layer_end=a.layers,
                                         block_size=16, num_heads=1, head_dim=64, dtype="bfloat16", tensors=descs)
                try:
                    m.register_engine(reg, caller=Caller("", os.getuid))
                    ok += 1
                except Exception as e:  # TooManyEngines, GeometryError where the tree bounds registrations
                    refused += 1
                    why = f"{type(e).__name__}: {str(e)[:90]}"
            dt = time.perf_counter() - t
            per = max(ok, 1)
            files_note = ", a file a layer" if a.file_per_layer else ""
            print(f"{a.layers} layers ({2 * a.layers} tensors{files_note}): {ok} registered, {refused} refused; "
                  f"a registered engine {(_rss() - rss) / per / 2**20:.2f} MiB of RSS, "
                  f"{dt / max(ok + refused, 1) * 1e3:.1f} ms, "
                  f"{(_maps() - maps) / per:.1f} maps, {(_fds() - fds) / per:.1f} descriptors; total "
                  f"+{(_rss() - rss) / 2**20:.0f} MiB"
                  + (f"; {why}" if refused else ""), flush=True)
    finally:
        for p in files:
            p.close()
        os.rmdir(shm)


if __name__ == "__main__":
    main()
