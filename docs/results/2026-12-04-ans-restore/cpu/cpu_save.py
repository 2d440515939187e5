"""The CPU path's save of exact segments of host pages (`none`), in process, as the pipeline bench's CPU command
makes it (8 layers, 512 blocks of 32 KiB, one chunk per segment size's worth of blocks, invalidate then save,
repeated): the wall and thread CPU per segment and GB/s, medians after 3 warm-up saves. With a third argument, a
line_profiler of the save's batch steps to that file (its overhead inflates the per-call lines several times).
Usage: python cpu_save.py SEGMENT_KIB REPEAT [PROFILE.txt]"""
import gc, sys, time, statistics
from orbitkv_fs.tools import bench_pipeline as B
from orbitkv_fs.manager import Manager, ManagerConfig, ChunkBlocks
from orbitkv_fs.keys import chunk_key
kib = int(sys.argv[1]); rep = int(sys.argv[2]); prof = sys.argv[3] if len(sys.argv) > 3 else None
blocks, layers = 512, 8
pages, reg = B._engine(blocks, layers)
m = Manager(ManagerConfig(pool_size=2 * blocks * B.BLOCK_BYTES * layers * 2 + (64 << 20), storage_codec="none",
                          storage_codec_budget=64 << 20, device="cpu"))
e = m.register_engine(reg)
per = (kib << 10) // B.BLOCK_BYTES
chunks = [ChunkBlocks(chunk_key(f"x-{i}"), list(range(i * per, (i + 1) * per))) for i in range(blocks // per)]
gc.collect(); gc.freeze()
lp = None
if prof:
    from line_profiler import LineProfiler
    from orbitkv_fs.manager.hostpath import HostPath
    from orbitkv_fs.tiers.dram import DramTier
    from orbitkv_fs.index import ObjectIndex
    from orbitkv_fs.manager import save as S
    lp = LineProfiler()
    for f in (HostPath._save_raw_batch, DramTier._publish_many, ObjectIndex.add_many, S.SavePipeline._save_items, S.SavePipeline.save):
        lp.add_function(f)
cpu, wall = [], []
for r in range(rep):
    m.invalidate(all=True)
    if lp and r == 3: lp.enable_by_count()
    t, c = time.perf_counter(), time.thread_time()
    res = m.save(e.engine_id, chunks)
    wall.append(time.perf_counter() - t); cpu.append(time.thread_time() - c)
if lp:
    lp.disable_by_count()
    with open(prof, "w") as f: lp.print_stats(stream=f, output_unit=1e-6, stripzeros=True)
n = res.segments
print(f"{kib} KiB: {n} segs, wall {statistics.median(wall[3:])*1e6/n:.2f} us/seg, cpu {statistics.median(cpu[3:])*1e6/n:.2f} us/seg, "
      f"{n*(kib<<10)/statistics.median(wall[3:])/1e9:.2f} GB/s")
m.close(); pages.close()
