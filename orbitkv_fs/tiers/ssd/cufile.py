"""cuFile (GPUDirect Storage) backend of the SSD tier, through kvikio; kvikio runs in compatibility mode
(POSIX I/O from its own thread pool) where no GDS driver exists.

Owns: kvikio ``CuFile`` handles of the shard files and :class:`CuFileRing`, which gives kvikio's futures
the tier's :class:`~orbitkv_fs.tiers.ssd.uring.IoRing` interface: each prepped operation is issued to
kvikio at submit, a waiter thread blocks on its future and posts ``(tag, result)`` to the ring's eventfd,
so the writeback lane waits on kvikio exactly as on io_uring. Buffers may be host (memoryview, numpy) or
device (CuPy) arrays; kvikio moves device buffers without a host bounce where GDS is present.

The tier's direct path runs over this backend: ``SsdTier.submit_device`` queues block-aligned device
staging buffers on the writeback ring, ``SsdTier.read_many_device`` reads records into device windows
through a demand-read ring. In compatibility mode kvikio itself bounces through its own pinned buffers;
the tier and the Manager never do.

kvikio is imported lazily: the core package never needs it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import functools
import os
import threading
from typing import Any

from .uring import EventfdRing, SsdIoError


@functools.cache
def cufile_usable() -> bool:
    """kvikio importable and a CUDA device present."""
    try:
        import cupy
        import kvikio  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no kvikio, no cupy, no driver, no device: all mean "not here"
        return False


def _as_array(buf: Any) -> Any:
    if isinstance(buf, memoryview):
        import numpy as np

        return np.frombuffer(buf, dtype=np.uint8)
    return buf


class CuFileRing(EventfdRing):
    def __init__(self, entries: int, files: dict[int, Any]) -> None:
        self._files = files
        self._entries = entries
        self._prepped: list[tuple[bool, int, Any, int, int]] = []
        self._inflight = 0
        self._done: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=entries, thread_name_prefix="orbitkv-cufile")
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def space(self) -> int:
        return self._entries - self._inflight - len(self._prepped)

    def unsent(self) -> int:
        return len(self._prepped)

    def prep_write(self, fid: int, buf: Any, offset: int, tag: int) -> None:
        self._prepped.append((True, fid, buf, offset, tag))

    def prep_read(self, fid: int, buf: Any, offset: int, tag: int) -> None:
        self._prepped.append((False, fid, buf, offset, tag))

    def _run(self, write: bool, fid: int, buf: Any, offset: int, tag: int) -> None:
        f = self._files[fid]
        arr = _as_array(buf)
        try:
            fut = f.pwrite(arr, arr.nbytes, offset) if write else f.pread(arr, arr.nbytes, offset)
            res = int(fut.get())
        except Exception:  # kvikio raises RuntimeError with the errno text; the tier only needs "failed"
            res = -errno.EIO
        with self._lock:
            self._done.append((tag, res))
        os.eventfd_write(self.eventfd, 1)

    def submit(self) -> None:
        for op in self._prepped:
            self._pool.submit(self._run, *op)
        self._inflight += len(self._prepped)
        self._prepped.clear()

    def reap(self) -> list[tuple[int, int]]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        self._inflight -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self.eventfd)


class CuFileBackend:
    name = "cufile"

    def __init__(self) -> None:
        import kvikio

        self._kvikio = kvikio
        self._files: dict[int, Any] = {}

    def open(self, path: str, size: int, *, truncate: bool) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if truncate:
                    os.ftruncate(fd, 0)
                if os.fstat(fd).st_size < size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            handle = self._kvikio.CuFile(path, "r+")
        except (OSError, RuntimeError) as e:
            raise SsdIoError(f"cannot open {path} for cuFile: {e}") from None
        fid = len(self._files)
        self._files[fid] = handle
        return fid

    def ring(self, entries: int) -> CuFileRing:
        return CuFileRing(entries, self._files)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
