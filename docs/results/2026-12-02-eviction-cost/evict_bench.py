"""Save rate of `none` 32 KiB segments on the CPU host path (512 blocks, 8 layers: 8,192 segments a save) with and
without DRAM pressure, the pipeline bench's engine pages: 'fresh' invalidates the pool before each save (as
`orbitkv-bench pipeline` does, so its saves never evict); 'pressure' gives a pool of about one save's bytes and
saves new keys every time, so that each save evicts as many segments as it admits (a serving engine's steady
state once its prefixes outgrow DRAM). Prints the median of 8 saves: wall ms, this thread's CPU us per segment,
GB/s. Usage: python evict_bench.py MODE...   (MODE: fresh | pressure, in the order given)"""
import statistics
import sys
import time

from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.tools.bench_pipeline import BLOCK_BYTES, _engine

blocks, layers = 512, 8
pages, reg = _engine(blocks, layers)
seg_bytes = BLOCK_BYTES  # 32 KiB per layer/role
nseg = blocks * layers * 2
try:
    for arg in sys.argv[1:]:
        mode, _, policy = arg.partition(":")
        pool = (nseg * (seg_bytes + 512) * (1 if mode == "pressure" else 3)) + (16 << 20)
        with Manager(ManagerConfig(pool_size=pool, device="cpu", eviction=policy or "lru")) as m:
            e = m.register_engine(reg)
            ts, cpu = [], []
            for rep in range(8):
                chunks = [ChunkBlocks(chunk_key(f"{mode}-{rep}-{i}"), [i]) for i in range(blocks)]
                if mode == "fresh":
                    m.invalidate(all=True)
                c0, t0 = time.thread_time(), time.perf_counter()
                r = m.save(e.engine_id, chunks)
                ts.append(time.perf_counter() - t0); cpu.append(time.thread_time() - c0)
                assert r.segments == nseg, (r.segments, r.dropped_segments)
            print(f"{arg:>16}: save median {statistics.median(ts) * 1e3:.1f} ms, "
                  f"{statistics.median(cpu) / nseg * 1e6:.2f} us CPU per segment, "
                  f"{nseg * seg_bytes / statistics.median(ts) / 1e9:.2f} GB/s")
finally:
    pages.close()  # its /dev/shm file goes with it
