"""CPU cost per record of the SSD tier's write and read paths, and of a Manager lookup served from the SSD
tier, this tree against a baseline copy of the package, in one process, alternating rounds (ABBA).

The tier runs over an in-memory I/O backend (:class:`MemBackend`: its rings copy buffers to and from
``bytearray`` "files" and complete at once), so the figures are the tier's own work per record (staging
copy, record header and tag, allocation, the lane, publish; reading back, checks, copy out) without the
device's noise: what the trust checks add. Per round and package:

* ``submit_us``: ``submit(timeout=...)`` of N segments, then ``flush``; CPU microseconds per record.
* ``read_us``: ``read_many`` of all N keys (32 at a time); CPU microseconds per record.
* ``lookup_us``: ``Manager.lookup(lease=False)`` of one chunk (16 segments) that only the tier holds
  (``flush_dram`` between calls drops the DRAM copies without writing); CPU microseconds per call, p50.

Segment sizes 64 KiB and 1 MiB. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
sys.path.insert(0, os.path.dirname(__file__))
from membackend import MemBackend  # noqa: E402
from ssd_trust_bench import BLOCK_TOKENS, HEAD_DIM, HEADS, LAYERS, load_as  # noqa: E402


def _segments(pkg: str, seg_bytes: int, n: int) -> list[bytes]:
    seg = importlib.import_module(f"{pkg}.segment")
    import numpy as np

    out = []
    for i in range(n):
        payload = np.random.default_rng(i).integers(0, 255, seg_bytes - 64, dtype=np.uint8).tobytes()
        out.append(seg.build_segment(seg.SegmentHeader(seg.Format.RAW, np.dtype(np.uint8), len(payload),
                                                       len(payload), 0, role=seg.Role.KEY), payload))
    return out


def tier_round(pkg: str, directory: str, seg_bytes: int, n: int) -> dict[str, float]:
    ssd = importlib.import_module(f"{pkg}.tiers.ssd")
    keys_mod = importlib.import_module(f"{pkg}.keys")
    segs = _segments(pkg, seg_bytes, 8)
    keys = [keys_mod.ObjectKey(b"bench-trust-0000", keys_mod.chunk_key(i), 0, keys_mod.Role.KEY) for i in range(n)]
    path = os.path.join(directory, f"{pkg}-{seg_bytes}.okv")
    t = ssd.SsdTier(ssd.SsdConfig(paths=(path,), capacity=n * (seg_bytes + 4096) + (64 << 20)), backend=MemBackend())
    try:
        c0 = time.process_time()
        for i, k in enumerate(keys):
            assert t.submit(k, segs[i % 8], timeout=10.0)
        t.flush()
        c1 = time.process_time()
        for j in range(0, n, 32):
            got = t.read_many(keys[j:j + 32])
            assert all(g is not None for g in got)
        c2 = time.process_time()
    finally:
        t.close()
        if os.path.exists(path):
            os.unlink(path)
    return {"submit_us": (c1 - c0) / n * 1e6, "read_us": (c2 - c1) / n * 1e6}


def lookup_round(pkg: str, directory: str, samples: int) -> dict[str, float]:
    mgr = importlib.import_module(f"{pkg}.manager")
    keys = importlib.import_module(f"{pkg}.keys")
    pages_mod = importlib.import_module(f"{pkg}.pages")
    ssd = importlib.import_module(f"{pkg}.tiers.ssd")
    import ml_dtypes
    import numpy as np

    per_chunk, n_chunks = 2, 8  # 64 KiB segments
    pages, descs = pages_mod.host_engine_pages(num_layers=LAYERS, num_blocks=per_chunk * n_chunks,
                                               block_size=BLOCK_TOKENS, num_heads=HEADS, head_dim=HEAD_DIM)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = np.random.default_rng(3).standard_normal(a.shape).astype(ml_dtypes.bfloat16)
    reg = mgr.EngineRegistration(model="bench", num_layers=LAYERS, layer_start=0, layer_end=LAYERS,
                                 block_size=BLOCK_TOKENS, num_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                                 tensors=descs)
    chunks = [mgr.ChunkBlocks(keys.chunk_key(f"c{i}"), [per_chunk * i, per_chunk * i + 1]) for i in range(n_chunks)]
    path = os.path.join(directory, f"{pkg}-lookup.okv")
    tier = ssd.SsdTier(ssd.SsdConfig(paths=(path,), capacity=64 << 20), backend=MemBackend())
    try:
        with mgr.Manager(mgr.ManagerConfig(pool_size=64 << 20, storage_codec="none", ssd_prefetch_chunks=0),
                         lower_tier=tier) as m:
            e = m.register_engine(reg)
            m.save(e.engine_id, chunks)
            m.flush_dram()
            cpu = []
            for i in range(samples):
                m.flush_dram()
                c0 = time.process_time()
                lk = m.lookup(e.engine_id, [chunks[i % n_chunks].key], lease=False)
                cpu.append(time.process_time() - c0)
                assert lk.count == 1
    finally:
        pages.close()
        if os.path.exists(path):
            os.unlink(path)
    return {"lookup_us": statistics.median(cpu) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="directory of the baseline orbitkv_fs package")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--records", type=int, default=2000, help="records per round at 64 KiB (1 MiB: a sixteenth)")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_as("base_orbitkv", os.path.abspath(args.baseline))
    import tempfile

    import orbitkv_fs

    directory = tempfile.mkdtemp(prefix="orbitkv-tier-cpu-")
    packages = {"main": "base_orbitkv", "trust": "orbitkv_fs"}
    rounds = []
    for r in range(args.rounds):
        order = ["main", "trust"] if r % 2 == 0 else ["trust", "main"]
        for name in order:
            fig = {}
            for seg_bytes, n in ((64 << 10, args.records), (1 << 20, max(args.records // 16, 32))):
                for k, v in tier_round(packages[name], directory, seg_bytes, n).items():
                    fig[f"{seg_bytes >> 10}KiB/{k}"] = v
            fig.update(lookup_round(packages[name], directory, args.samples))
            rounds.append({"round": r, "package": name, **fig})
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    os.rmdir(directory)
    summary = {}
    for fig in [k for k in rounds[0] if k not in ("round", "package")]:
        vals = {n: [x[fig] for x in rounds if x["package"] == n] for n in packages}
        summary[fig] = {"main_median": statistics.median(vals["main"]), "trust_median": statistics.median(vals["trust"]),
                        "diff_median": statistics.median(t - b for t, b in zip(vals["trust"], vals["main"])),
                        "ratio_median": statistics.median(t / b for t, b in zip(vals["trust"], vals["main"])),
                        # Other work on the machine only adds CPU time: the least is the cost itself.
                        "main_min": min(vals["main"]), "trust_min": min(vals["trust"]),
                        "ratio_min": min(vals["trust"]) / min(vals["main"])}
    doc = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_at_end": os.getloadavg(),
           "orbitkv_fs": orbitkv_fs.__file__, "summary": summary, "rounds": rounds}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
