"""Bytes of the Manager's memory a lookup lease adds per pinned chunk: an embedded Manager saves 16,384 chunks of one
block, then tracemalloc measures one leased lookup of all of them. Usage: PYTHONPATH=PKG python pin_memory.py"""

import tracemalloc, gc
from orbitkv_fs.connectors.common import StagingPages
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
n = 16384
with Manager(ManagerConfig(pool_size=400 << 20, device="cpu", engine_check_interval=0, lease_ttl=0)) as m:
    p = StagingPages(num_layers=2, slots=n, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    e = m.register_engine(p.registration(model="m", engine_kind="test"))
    chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(n)]
    for j in range(0, n, 2048):
        m.save(e.engine_id, chunks[j:j + 2048])
    keys = [c.key for c in chunks]
    gc.collect()
    tracemalloc.start()
    s0 = tracemalloc.take_snapshot()
    lk = m.lookup(e.engine_id, keys)
    s1 = tracemalloc.take_snapshot()
    assert lk.count == n and lk.lease_id
    print("bytes per pinned chunk: %.1f" % (sum(s.size_diff for s in s1.compare_to(s0, "filename")) / n))
    p.close()
