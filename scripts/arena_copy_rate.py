"""Copy rate between the GPU and the Manager's DRAM arena (:class:`orbitkv_fs.tiers.dram.Arena`: a /dev/shm
mapping that registers itself with cudaHostRegister) against cudaMallocHost memory: 512 MiB of cudaMemcpyAsync
in 256 KiB .. 32 MiB chunks, back to back on one stream, each direction. Needs a GPU and cupy; prints one line
per case.

    python scripts/arena_copy_rate.py

(docs/results/2026-11-30-pipeline-gpu-3/arena_copy_rate.txt also has a MADV_HUGEPAGE mapping: the script of
commit 31f3105 built its own mapping for that; it changed nothing and is not measured any more.)
"""

import time

import cupy as cp
import numpy as np

from orbitkv_fs.tiers.dram import Arena

HOST_BYTES = 1 << 30
COPY_BYTES = HOST_BYTES // 2
CHUNKS = (256 << 10, 1 << 20, 4 << 20, 32 << 20)


def copy_rate(dev: cp.ndarray, host_ptr: int, chunk: int, d2h: bool, stream: cp.cuda.Stream) -> float:
    """GB/s of COPY_BYTES in ``chunk`` copies (the second of two passes)."""
    n = COPY_BYTES // chunk
    for _ in range(2):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        for i in range(n):
            d, h = dev.data.ptr + i * chunk, host_ptr + i * chunk
            if d2h:
                cp.cuda.runtime.memcpyAsync(h, d, chunk, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            else:
                cp.cuda.runtime.memcpyAsync(d, h, chunk, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        e1.record(stream)
        e1.synchronize()
    return COPY_BYTES / (cp.cuda.get_elapsed_time(e0, e1) / 1e3) / 1e9


def main() -> None:
    dev = cp.full(COPY_BYTES, 7, dtype=np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    pinned = cp.cuda.alloc_pinned_memory(HOST_BYTES)
    t = time.perf_counter()
    arena = Arena(HOST_BYTES)
    setup = time.perf_counter() - t
    if not arena.pinned:
        raise SystemExit("the arena could not be registered with CUDA")
    try:
        for name, ptr, secs in (("cudaMallocHost", pinned.ptr, 0.0), ("Manager arena", arena.base_address, setup)):
            for chunk in CHUNKS:
                print(f"{name:16s} setup {secs:5.2f} s  chunk {chunk >> 10:6d} KiB  "
                      f"D2H {copy_rate(dev, ptr, chunk, True, stream):5.1f} GB/s  "
                      f"H2D {copy_rate(dev, ptr, chunk, False, stream):5.1f} GB/s", flush=True)
    finally:
        arena.close()


if __name__ == "__main__":
    main()
