"""Cost of the SSD log's trust checks (issue 23): the Manager's save/restore pipeline through the SSD tier
and its lookups, this tree's ``orbitkv_fs`` against a baseline copy of the package (main before the
change), both imported in one process under different names and measured in alternating rounds (ABBA), on
the same data, so that the machine's load hits both alike.

Per round and package, with host engine pages (8 layers, K and V, bf16, 16-token blocks of 8 heads x 128:
32 KiB per block, layer and role), codec ``none``, pages and the DRAM arena in /dev/shm, an SSD tier on a fresh O_DIRECT shard in ``--dir``:

* ``save+flush``: ``Manager.save`` of ``--mib`` of chunks into DRAM, then ``flush_dram`` (every segment
  written to the SSD: staging, record header and tag, the lane, two-phase publish); GB/s of segment bytes
  over both steps. ``flush`` alone: the writeback part.
* ``restore``: ``Manager.restore`` of every chunk with DRAM empty (every segment read from the SSD and
  checked: header CRC, fields against the index, payload CRC32C); GB/s of segment bytes.
* ``lookup_ssd``: ``Manager.lookup(lease=False)`` of one chunk (16 segments) that only the SSD holds (the
  lookup reads and checks its records and admits them to DRAM; ``flush_dram`` between samples drops them
  again without writing); microseconds, p50 over ``--samples``.
* ``lookup_dram``: ``Manager.lookup(lease=False)`` of 64 chunks held in DRAM; microseconds, p50.

Besides wall-clock figures, the CPU seconds of the whole process (every thread) per GB saved or restored,
and per SSD lookup: the added checks are CPU work, and CPU time is much less disturbed than wall time by
other processes on a shared machine.

Segment sizes: 64 KiB (2 blocks a chunk) and 1 MiB (32 blocks). ``--backend mem`` replaces the device with
an in-memory backend (``membackend.py``): the pipeline's own work, where the checks weigh most. Prints one JSON document (every round's
figures, and per figure the median of each package and the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from membackend import MemBackend  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 8, 128, 16
BLOCK_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * 2


def load_as(name: str, package_dir: str):
    """The package in ``package_dir`` imported as ``name`` (its imports are relative)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(package_dir, "__init__.py"),
                                                  submodule_search_locations=[package_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def one_round(pkg: str, directory: str, seg_bytes: int, total: int, samples: int, mem: bool = False) -> dict[str, float]:
    mgr = importlib.import_module(f"{pkg}.manager")
    keys = importlib.import_module(f"{pkg}.keys")
    pages_mod = importlib.import_module(f"{pkg}.pages")
    ssd = importlib.import_module(f"{pkg}.tiers.ssd")
    import ml_dtypes
    import numpy as np

    per_chunk = seg_bytes // BLOCK_BYTES
    n_chunks = max(total // (seg_bytes * 2 * LAYERS), 2)
    pages, descs = pages_mod.host_engine_pages(num_layers=LAYERS, num_blocks=per_chunk * n_chunks,
                                               block_size=BLOCK_TOKENS, num_heads=HEADS, head_dim=HEAD_DIM)
    rng = np.random.default_rng(7)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = rng.standard_normal(a.shape).astype(ml_dtypes.bfloat16)
    reg = mgr.EngineRegistration(model="bench", num_layers=LAYERS, layer_start=0, layer_end=LAYERS,
                                 block_size=BLOCK_TOKENS, num_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                                 tensors=descs)
    chunks = [mgr.ChunkBlocks(keys.chunk_key(f"c{i}"), list(range(per_chunk * i, per_chunk * (i + 1))))
              for i in range(n_chunks)]
    shard = os.path.join(directory, f"{pkg}.okv")
    tier = ssd.SsdTier(ssd.SsdConfig(paths=(shard,), capacity=4 * total + (64 << 20)),
                       backend=MemBackend() if mem else None)
    out: dict[str, float] = {}
    try:
        with mgr.Manager(mgr.ManagerConfig(pool_size=4 * total, storage_codec="none", ssd_prefetch_chunks=0),
                         lower_tier=tier) as m:
            e = m.register_engine(reg)
            seg_total = seg_bytes * 2 * LAYERS * n_chunks
            c0, t0 = time.process_time(), time.perf_counter()
            m.save(e.engine_id, chunks)
            t1 = time.perf_counter()
            f = m.flush_dram()
            tier.flush()
            c2, t2 = time.process_time(), time.perf_counter()
            assert f.dropped.objects == 0 and f.submitted.objects == 2 * LAYERS * n_chunks, f
            out["save+flush_gbps"] = seg_total / (t2 - t0) / 1e9
            out["flush_gbps"] = seg_total / (t2 - t1) / 1e9
            # CPU seconds of every thread of the process per GB: the added work itself, much less sensitive
            # to other processes on the machine than wall-clock throughput.
            out["save+flush_cpu_s_per_gb"] = (c2 - c0) / (seg_total / 1e9)
            c0, t0 = time.process_time(), time.perf_counter()
            r = m.restore(e.engine_id, chunks)
            c1, t1 = time.process_time(), time.perf_counter()
            assert all(r.restored), r.misses
            out["restore_gbps"] = seg_total / (t1 - t0) / 1e9
            out["restore_cpu_s_per_gb"] = (c1 - c0) / (seg_total / 1e9)
            lat, cpu = [], []
            for i in range(samples):
                m.flush_dram()  # drops the DRAM copies; the SSD holds them already, nothing is written
                c = chunks[i % n_chunks].key
                c0, t0 = time.process_time(), time.perf_counter()
                lk = m.lookup(e.engine_id, [c], lease=False)
                cpu.append(time.process_time() - c0)
                lat.append(time.perf_counter() - t0)
                assert lk.count == 1
            out["lookup_ssd_p50_us"] = statistics.median(lat) * 1e6
            out["lookup_ssd_cpu_p50_us"] = statistics.median(cpu) * 1e6
            m.save(e.engine_id, chunks[:64])
            ks = [c.key for c in chunks[:64]]
            lat = []
            for _ in range(samples):
                t0 = time.perf_counter()
                lk = m.lookup(e.engine_id, ks, lease=False)
                lat.append(time.perf_counter() - t0)
            assert lk.count == min(64, n_chunks)
            out["lookup_dram_p50_us"] = statistics.median(lat) * 1e6
    finally:
        pages.close()
        if os.path.exists(shard):
            os.unlink(shard)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="directory of the baseline orbitkv_fs package")
    p.add_argument("--rounds", type=int, default=8, help="rounds per package and size (ABBA order)")
    p.add_argument("--mib", type=int, default=64, help="logical MiB saved and restored per round")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--dir", default=None, help="scratch directory on an O_DIRECT file system")
    p.add_argument("--backend", choices=("disk", "mem"), default="disk",
                   help="disk: the shard on --dir through io_uring; mem: an in-memory backend (membackend.py): "
                        "the pipeline's own work, without the device")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_as("base_orbitkv", os.path.abspath(args.baseline))
    import orbitkv_fs

    scratch = tempfile.mkdtemp(prefix="orbitkv-trust-bench-", dir=args.dir)
    packages = {"main": "base_orbitkv", "trust": "orbitkv_fs"}
    rounds: list[dict] = []
    try:
        for seg_bytes in (64 << 10, 1 << 20):
            for r in range(args.rounds):
                order = ["main", "trust"] if r % 2 == 0 else ["trust", "main"]
                for name in order:
                    fig = one_round(packages[name], scratch, seg_bytes, args.mib << 20, args.samples,
                                    mem=args.backend == "mem")
                    rounds.append({"segment_bytes": seg_bytes, "round": r, "package": name, **fig})
                    print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for seg_bytes in (64 << 10, 1 << 20):
        for fig in ("save+flush_gbps", "flush_gbps", "restore_gbps", "save+flush_cpu_s_per_gb", "restore_cpu_s_per_gb",
                    "lookup_ssd_p50_us", "lookup_ssd_cpu_p50_us", "lookup_dram_p50_us"):
            vals = {n: [x[fig] for x in rounds if x["package"] == n and x["segment_bytes"] == seg_bytes]
                    for n in packages}
            ratios = [t / b for t, b in zip(vals["trust"], vals["main"])]
            diffs = [t - b for t, b in zip(vals["trust"], vals["main"])]
            # Other work on the machine only slows a round down: the best round is the cost itself.
            best = max if fig.endswith("gbps") else min
            summary[f"{seg_bytes >> 10}KiB/{fig}"] = {
                "main_median": statistics.median(vals["main"]), "trust_median": statistics.median(vals["trust"]),
                "ratio_median": statistics.median(ratios), "diff_median": statistics.median(diffs),
                "main_best": best(vals["main"]), "trust_best": best(vals["trust"]),
                "ratio_best": best(vals["trust"]) / best(vals["main"])}
    doc = {"command": " ".join(sys.argv), "host": platform.node(), "cpus": os.cpu_count(),
           "load_at_end": os.getloadavg(), "orbitkv_fs": orbitkv_fs.__file__, "summary": summary, "rounds": rounds}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
