"""Lookup latency over the data plane: a baseline tree (main, before the credential checks) against this
tree, alternating round by round in one run on one machine.

For each tree a server process (a Manager and its DataPlaneServer on an ipc:// socket) and a client
process (a RemoteClient that registered an engine and saved 64 chunks of 2 blocks) start from that tree's
own code (``cwd`` = the tree: ``orbitkv_fs`` resolves there). The parent then asks the two clients in
turn, ``--rounds`` times (which tree goes first alternates), for ``--calls`` lookups of ``--chunks`` chunk
keys each -- lease-free (a scheduler's lookup) and leased (a worker's; the lease is released outside the
timed call) -- and keeps every call's latency. Figures: p50/p90/p99 per tree and the p50 difference.

    python docs/results/2026-12-01-dataplane-trust/bench.py --baseline /tmp/main-tree --out results.json

where /tmp/main-tree is ``git archive main | tar -x -C /tmp/main-tree``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SERVER = r"""
import sys, time
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.dataplane import DataPlaneServer
m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu"))
srv = DataPlaneServer(m, sys.argv[1], workers=4)
print("up", flush=True)
sys.stdin.read()
srv.close()
m.close()
"""

CLIENT = r"""
import json, sys, time
import numpy as np
from orbitkv_fs.dataplane import RemoteClient
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks
from orbitkv_fs.pages import host_engine_pages

pages, descs = host_engine_pages(num_layers=4, num_blocks=128, block_size=16, num_heads=2, head_dim=64)
reg = EngineRegistration(model="bench", num_layers=4, layer_start=0, layer_end=4, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=descs)
c = RemoteClient(sys.argv[1], timeout=60)
eid = c.register(reg).engine_id
keys = [chunk_key(f"k{i}") for i in range(64)]
c.save(eid, [ChunkBlocks(k, [2 * i, 2 * i + 1]) for i, k in enumerate(keys)])
print("up", flush=True)
for line in sys.stdin:
    calls, n, lease = (int(x) for x in line.split())
    want = keys[:n]
    out = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        r = c.lookup(eid, want, lease=bool(lease))
        out.append(time.perf_counter_ns() - t)
        assert r.count == n
        if r.lease_id:
            c.release(r.lease_id)
    print(json.dumps(out), flush=True)
c.unregister(eid)
c.close()
pages.close()
"""


def _spawn(program: str, tree: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", program, *args], cwd=tree, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "up":
        raise RuntimeError(f"{tree}: did not start ({line!r})")
    return p


def _pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a checkout of the baseline (main)")
    ap.add_argument("--current", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))), help="this tree (default: the repository root)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = {"baseline": os.path.abspath(args.baseline), "current": os.path.abspath(args.current)}
    tmp = tempfile.mkdtemp(prefix="orbitkv-bench-trust-")
    procs: dict[str, tuple[subprocess.Popen, subprocess.Popen]] = {}
    samples = {(name, lease): [] for name in trees for lease in (0, 1)}
    rounds = []
    try:
        for name, tree in trees.items():
            endpoint = f"ipc://{tmp}/{name}.sock"
            server = _spawn(SERVER, tree, endpoint)
            procs[name] = (server, _spawn(CLIENT, tree, endpoint))
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            row = {}
            for lease in (0, 1):
                for name in order:
                    client = procs[name][1]
                    client.stdin.write(f"{args.calls} {args.chunks} {lease}\n")
                    client.stdin.flush()
                    lat = json.loads(client.stdout.readline())
                    samples[(name, lease)].extend(lat)
                    row[f"{name}_{'leased' if lease else 'lease_free'}_p50_us"] = _pct(lat, 0.5)
            rounds.append(row)
    finally:
        for server, client in procs.values():
            for p in (client, server):
                p.stdin.close()
                p.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "host": platform.node(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "rounds": args.rounds,
           "calls_per_round": args.calls, "chunks_per_lookup": args.chunks, "per_round": rounds}
    for lease in (0, 1):
        kind = "leased" if lease else "lease_free"
        for name in trees:
            xs = samples[(name, lease)]
            out[f"{name}_{kind}"] = {"p50_us": _pct(xs, 0.5), "p90_us": _pct(xs, 0.9), "p99_us": _pct(xs, 0.99),
                                    "mean_us": statistics.fmean(xs) / 1000, "calls": len(xs)}
        out[f"{kind}_p50_delta_us"] = out[f"current_{kind}"]["p50_us"] - out[f"baseline_{kind}"]["p50_us"]
        per_round = [row[f"current_{kind}_p50_us"] - row[f"baseline_{kind}_p50_us"] for row in rounds]
        out[f"{kind}_round_p50_delta_us"] = {"median": statistics.median(per_round), "min": min(per_round),
                                            "max": max(per_round)}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
