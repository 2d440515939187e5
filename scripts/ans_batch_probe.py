"""nvCOMP ANS compression: one batched call over 512 MiB of 64 KiB chunks against the same bytes in equal
batches of 4-256 MiB, back to back on one stream and round robin over 2 and 4 streams; nvCOMP alone (no pack,
no CRC32C). Shows the fixed cost per call that makes small batches slow. Needs a GPU, cupy and nvCOMP:

    ORBITKV_REAL_KV=.kvdata/smollm2_kv_sample.npz python scripts/ans_batch_probe.py

(without ORBITKV_REAL_KV the data is Gaussian BF16, which ANS compresses differently)."""
import os

import cupy as cp
import numpy as np

from orbitkv_fs.gpu import ans_format, nvcomp
from orbitkv_fs.gpu import bench as b
from orbitkv_fs.segment import AnsType

nv = nvcomp.load()
kh, vh, what = b._load_kv(os.environ.get("ORBITKV_REAL_KV"))
total = 512 << 20
src = b._tile(kh, total // 2)
t = AnsType.FLOAT16
cb = ans_format.CHUNK_BYTES
cap = -(-nv.max_compressed_bytes(cb, t) // 256) * 256
out = cp.empty(total // cb * cap, dtype=np.uint8)


def batch(off: int, n: int) -> dict:
    """Device arrays of one nvCOMP call over the 64 KiB chunks of src[off:off + n]."""
    c = n // cb
    j = np.arange(c, dtype=np.uint64)
    arr = cp.asarray(np.concatenate([src.data.ptr + off + cb * j, np.full(c, cb, np.uint64),
                                     out.data.ptr + (off // cb) * cap + cap * j]).astype(np.uint64))
    temp = nv.compress_temp_bytes(c, cb, n, t)
    return dict(c=c, arr=arr, temp=temp, tb=cp.empty(max(temp, 1), dtype=np.uint8),
                sizes=cp.zeros(c, dtype=np.uint64), st=cp.full(c, -1, dtype=np.int32))


def run(bs: list, streams: list) -> None:
    """Submit the batches round robin over ``streams``, joined back to the current stream."""
    main = cp.cuda.get_current_stream()
    ev = main.record()
    for s in streams:
        s.wait_event(ev)
    for i, x in enumerate(bs):
        s = streams[i % len(streams)]
        a = x["arr"].data.ptr
        nv.compress(a, a + 8 * x["c"], cb, x["c"], x["tb"].data.ptr, x["temp"], a + 16 * x["c"], x["sizes"].data.ptr,
                    t, x["st"].data.ptr, s.ptr)
    for s in streams:
        main.wait_event(s.record())


print(f"data: {what}; {total >> 20} MiB, 64 KiB chunks, nvCOMP alone (no pack, no CRC)")
single = [batch(0, total)]
one = [cp.cuda.get_current_stream()]
t1 = b._median_time(lambda: run(single, one), 10)
print(f"one call: {t1 * 1e3:.3f} ms  {b._gbps(total, t1):.1f} GB/s")
pool = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
for mb in (256, 128, 64, 32, 16, 8, 4):
    bs = [batch(o, mb << 20) for o in range(0, total, mb << 20)]
    row = []
    for ns in (1, 2, 4):
        tt = b._median_time(lambda: run(bs, one if ns == 1 else pool[:ns]), 10)
        row.append(f"{ns} stream(s) {tt * 1e3:7.3f} ms {t1 / tt:5.2f}x")
    ok = all(int(x["st"].max()) == 0 for x in bs)
    print(f"batches of {mb:3d} MiB ({len(bs):3d}): " + " | ".join(row) + f"  statuses ok {ok}", flush=True)
