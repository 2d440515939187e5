"""Copy rate between the GPU and a cudaHostRegister'ed /dev/shm mapping (as the Manager's DRAM arena) against
cudaMallocHost memory: 512 MiB of cudaMemcpyAsync in 256 KiB .. 32 MiB chunks, back to back on one stream, each
direction, with and without MADV_HUGEPAGE on the mapping. Needs a GPU and cupy; prints one line per case.

    python scripts/arena_copy_rate.py
"""

import mmap
import os
import time

import cupy as cp
import numpy as np

HOST_BYTES = 1 << 30
COPY_BYTES = HOST_BYTES // 2
CHUNKS = (256 << 10, 1 << 20, 4 << 20, 32 << 20)


def registered_shm(hugepages: bool) -> "tuple[mmap.mmap, np.ndarray, float]":
    """A /dev/shm mapping, faulted in and registered with CUDA; answers it, its array and the register time."""
    path = f"/dev/shm/arena_copy_rate_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, HOST_BYTES)
        mm = mmap.mmap(fd, HOST_BYTES)
    finally:
        os.close(fd)
        os.unlink(path)
    if hugepages:
        mm.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(mm, dtype=np.uint8)
    a[::4096] = 1
    t = time.perf_counter()
    cp.cuda.runtime.hostRegister(a.ctypes.data, HOST_BYTES, 0)
    return mm, a, time.perf_counter() - t


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
    keep = []
    cases = [("cudaMallocHost", pinned.ptr, 0.0)]
    for hp in (False, True):
        mm, a, reg = registered_shm(hp)
        keep.append((mm, a))
        cases.append((f"shm register{' +MADV_HUGEPAGE' if hp else ''}", a.ctypes.data, reg))
    for name, ptr, reg in cases:
        for chunk in CHUNKS:
            print(f"{name:28s} register {reg:5.2f} s  chunk {chunk >> 10:6d} KiB  "
                  f"D2H {copy_rate(dev, ptr, chunk, True, stream):5.1f} GB/s  "
                  f"H2D {copy_rate(dev, ptr, chunk, False, stream):5.1f} GB/s", flush=True)
    for _, a in keep:
        cp.cuda.runtime.hostUnregister(a.ctypes.data)
    with open("/proc/meminfo") as f:
        print("".join(line for line in f if "Huge" in line), end="")


if __name__ == "__main__":
    main()
