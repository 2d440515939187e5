"""In-process cost of ``Manager.lookup`` on 64 chunk keys (host pages, codec none, no lower tier, no peers),
of this tree's ``orbitkv_fs`` and, with ``--baseline DIR``, of another copy of the package (e.g. an older
commit: ``git archive <commit> orbitkv_fs | tar -x -C DIR``) imported in the same process under another
name, the two measured in alternating rounds so that the machine's load hits both alike.

Cases: a full hit under a lease followed by its release (a connector's lookup -> release), a full hit
without a lease, a miss at the first chunk (under a lease), the first half hit (lease + release). Per case
and package: the median and minimum over ``--rounds`` rounds of ``--calls`` calls, microseconds per call.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Callable


def load_as(name: str, package_dir: str):
    """The package in ``package_dir`` imported as ``name`` (its imports are relative)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(package_dir, "__init__.py"),
                                                  submodule_search_locations=[package_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def setup(pkg: str, keys: int, layers: int) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    mgr = importlib.import_module(f"{pkg}.manager")
    chunk_key = importlib.import_module(f"{pkg}.keys").chunk_key
    host_engine_pages = importlib.import_module(f"{pkg}.pages").host_engine_pages
    pages, descs = host_engine_pages(num_layers=layers, num_blocks=2 * keys, block_size=16, num_heads=2,
                                     head_dim=64)
    reg = mgr.EngineRegistration(model="m", num_layers=layers, layer_start=0, layer_end=layers, block_size=16,
                                 num_heads=2, head_dim=64, dtype="bfloat16", tensors=descs)
    m = mgr.Manager(mgr.ManagerConfig(pool_size=256 << 20, device="cpu"))
    e = m.register_engine(reg).engine_id
    chunks = [mgr.ChunkBlocks(chunk_key(f"k{i}"), [i]) for i in range(keys)]
    m.save(e, chunks)
    hit = [c.key for c in chunks]
    absent = [chunk_key(f"absent{i}") for i in range(keys)]
    half = hit[: keys // 2] + absent[keys // 2:]
    assert m.lookup(e, hit, lease=False).count == keys and m.lookup(e, half, lease=False).count == keys // 2
    cases = {"hit_lease_release": lambda: m.release(m.lookup(e, hit).lease_id),
             "hit_no_lease": lambda: m.lookup(e, hit, lease=False),
             "miss_first": lambda: m.lookup(e, absent),
             "hit_half_lease_release": lambda: m.release(m.lookup(e, half).lease_id)}

    def close() -> None:
        st = m.stats()
        assert (st.leases_active, st.reserved_bytes, st.inflight_requests) == (0, 0, 0)
        m.close()
        pages.close()

    return cases, close


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="directory of another orbitkv_fs package to compare with")
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    trees = {"tree": "orbitkv_fs"}
    if a.baseline:
        load_as("orbitkv_fs_baseline", os.path.abspath(a.baseline))
        trees = {"baseline": "orbitkv_fs_baseline", **trees}
    runs = {label: setup(pkg, a.keys, a.layers) for label, pkg in trees.items()}
    per = {label: {case: [] for case in cases} for label, (cases, _) in runs.items()}
    load0 = os.getloadavg()[0]
    for _ in range(a.rounds):
        for case in per["tree"]:
            for label, (cases, _) in runs.items():
                fn = cases[case]
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn()
                per[label][case].append((time.perf_counter() - t0) / a.calls * 1e6)
    for _, close in runs.values():
        close()
    out = {"keys": a.keys, "segments_per_chunk": 2 * a.layers, "rounds": a.rounds, "calls": a.calls,
           "baseline": a.baseline, "load_1min_start": load0, "load_1min_end": os.getloadavg()[0],
           "us_per_call": {label: {case: {"median": round(statistics.median(v), 2), "min": round(min(v), 2)}
                                   for case, v in cases.items()} for label, cases in per.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
