"""The restore's serial prefix on the host, timed on one Manager in whichever tree is importable: a restore of
32 chunks x 72 segments (36 layers, K and V; 2,304 keys, the bench's 512 KiB run) leases every DRAM extent
(``RestorePipeline._acquire`` with spans, as the GPU path calls it), reads their size fields as arrays
(``_check_device_batch``), and the lease is dropped. Best of many calls, microseconds per call and per key.
Segments are 1 block (32 KiB) so that the save is quick: the prefix's work does not depend on the size.
  PYTHONPATH=TREE python prefix_micro.py NAME OUT.json"""

from __future__ import annotations

import json
import sys
import time

from orbitkv_fs.keys import chunk_key, segment_keys
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.manager.leases import _Lease

try:  # the request's extents as arrays (this stop); a dict before
    from orbitkv_fs.manager.leases import Spans
except ImportError:
    Spans = None
from orbitkv_fs.tools.bench_pipeline import _engine

LAYERS, CHUNKS = 36, 32


def best_us(fn, n: int = 200) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    pages, reg = _engine(CHUNKS, LAYERS)
    with Manager(ManagerConfig(pool_size=256 << 20, storage_codec="none", device="cpu")) as m:
        e = m.register_engine(reg)
        chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(CHUNKS)]
        m.save(e.engine_id, chunks)
        eng = m._engines[e.engine_id]
        keys = [segment_keys(eng.ns, ch.key, eng.tails) for ch in chunks]
        flat = [k for ks in keys for k in ks]
        n = len(flat)

        def acquire() -> tuple:
            held = _Lease(e.engine_id)
            spans = Spans() if Spans is not None else {}
            m._acquire(flat, held, {}, {"lower": 0}, set(), None, spans)
            return held, spans

        def acquire_drop() -> None:
            held, _ = acquire()
            m._drop_lease(held)

        held, spans = acquire()
        check = lambda: m._check_device_batch(chunks, eng.segs, keys, spans)  # noqa: E731
        fit, _, _ = check()
        assert fit.all(), "every segment fits"
        out = {"keys": n, "us_per_call": {"acquire + drop lease": best_us(acquire_drop),
                                          "_check_device_batch": best_us(check)}}
        m._drop_lease(held)
        out["us_per_key"] = {k: v / n for k, v in out["us_per_call"].items()}
    pages.close()
    out["tree"] = sys.argv[1]
    json.dump(out, open(sys.argv[2], "w"), indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
