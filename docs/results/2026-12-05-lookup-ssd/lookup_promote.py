"""A lookup whose chunks are all on the SSD tier: the Manager reads every segment back into DRAM (checked,
admitted) before it answers, on the engine's scheduling path (vLLM asks in `get_num_new_matched_tokens`). 36
layers, chunks of 8 blocks of 16 tokens x 2 heads x 64 (BF16: 32 KiB segments), 16 chunks a lookup (1,152
segments); DRAM flushed to the SSD before each lookup. Median wall and this thread's CPU of REPS lookups.

Usage: PYTHONPATH=<tree> python lookup_promote.py DIR [REPS]"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))

from test_manager import make_engine  # noqa: E402

from orbitkv_fs.keys import chunk_key  # noqa: E402
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig  # noqa: E402
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier  # noqa: E402


def main() -> None:
    path = os.path.join(sys.argv[1], f"lookup-{os.getpid()}.okv")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    pages, reg = make_engine(num_layers=36, num_blocks=256)
    try:
        with Manager(ManagerConfig(pool_size=256 << 20),
                     lower_tier=SsdTier(SsdConfig(paths=(path,), capacity=2 << 30))) as m:
            e = m.register_engine(reg)
            chunks = [ChunkBlocks(chunk_key(f"c{i}"), list(range(i * 8, i * 8 + 8))) for i in range(16)]
            m.save(e.engine_id, chunks)
            walls, cpus = [], []
            for _ in range(reps):
                m.flush_dram()
                t0, c0 = time.perf_counter(), time.thread_time()
                lk = m.lookup(e.engine_id, [c.key for c in chunks])
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
                assert (lk.count, lk.lower) == (16, 16), lk
                m.release(lk.lease_id)
            assert m.stats().pool_used_bytes > 0
            nseg = len(chunks) * 36 * 2
            w, c = statistics.median(walls), statistics.median(cpus)
            print(f"lookup of 16 chunks from the SSD ({nseg} segments of 32 KiB): {w * 1e3:.1f} ms wall "
                  f"({w / nseg * 1e6:.1f} us a segment), {c * 1e3:.1f} ms CPU ({c / nseg * 1e6:.1f} us a segment)")
    finally:
        pages.close()
        os.unlink(path)


if __name__ == "__main__":
    main()
