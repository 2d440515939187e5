"""Staging buffers of the SSD tier: page-aligned host buffers (O_DIRECT) and block-aligned device buffers
(the cuFile direct path), pooled by size class (:func:`size_class`).

Primitives: :meth:`StagingPool.host` (a buffer of n bytes), :meth:`StagingPool.host_many` (one of each of
several sizes), :meth:`StagingPool.record_buffer` (host or device, with a uint8 array over it),
:meth:`StagingPool.recycle` (give one back).

Invariants: a buffer handed out is owned by the caller until recycled (a buffer the kernel may still
write into is never recycled); the pool keeps at most ``limit`` bytes of idle buffers per kind; buffers of
over 32 KiB live in 2 MiB huge pages (a large O_DIRECT request over 4 KiB pages is one scattered segment
per page: on the development VM's virtio disk each such 1 MiB write waited about 55 ms in the queue, 2 ms
from a huge page). Thread-safe (its own lock, never held while calling out).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any, Sequence

import numpy as np

from .record import BLOCK
from .uring import HUGE_PAGE, aligned_buffer

#: Staging buffers larger than this live in huge pages (64 KiB demand reads ran 2-3x faster from them on
#: the development VM); smaller ones in ordinary pages. The record of a 32 KiB segment (36 KiB) is above
#: it, as it was when classes were powers of two and it took a 64 KiB one.
HUGE_ABOVE = 32 << 10


def size_class(nbytes: int) -> int:
    """The pool's class of a buffer of ``nbytes``: whole 4 KiB pages, eight classes an octave below 2 MiB (at
    most 1/8 above ``nbytes``: a 32 KiB segment's 36 KiB record, and a 512 KiB segment's 532 KiB one, took
    64 KiB and 1 MiB classes when classes were powers of two, so the lane's staged bytes held 1.8-1.9x
    their records), whole huge pages from 2 MiB up (those buffers are mapped in huge pages anyway)."""
    if nbytes >= HUGE_PAGE:
        return -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    step = max(1 << max((nbytes - 1).bit_length() - 4, 0), BLOCK)
    return -(-max(nbytes, 1) // step) * step


class StagingPool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._host: dict[int, list[memoryview]] = {}
        self._host_bytes = 0
        # Device staging: size class -> free block-aligned CuPy buffers, and the whole buffer behind each
        # buffer handed out (by device address).
        self._device: dict[int, list[Any]] = {}
        self._device_bytes = 0
        self._owners: dict[int, Any] = {}

    def host(self, nbytes: int) -> memoryview:
        """A page-aligned buffer of ``nbytes``: pooled, or new (huge pages above :data:`HUGE_ABOVE`; classes
        below 2 MiB carved from one huge page, the spare parts going to the pool)."""
        cls = size_class(nbytes)
        with self._lock:
            buf = self._pop(cls)
        if buf is not None:
            return buf[:nbytes]
        if cls <= HUGE_ABOVE:
            return aligned_buffer(cls)[:nbytes]
        if cls >= HUGE_PAGE:
            return aligned_buffer(cls, huge=True)[:nbytes]
        # Carve the page into views that each own their part (a ctypes array is the exporter ``recycle``
        # finds in ``buf.obj``). A pool with no room for the spare ones would drop them: a 2 MiB page held
        # for one small buffer, so no carving then.
        with self._lock:
            room = self._host_bytes + HUGE_PAGE - cls <= self.limit
        if not room:
            return aligned_buffer(cls)[:nbytes]
        page = aligned_buffer(HUGE_PAGE, huge=True)
        views = [memoryview((ctypes.c_char * cls).from_buffer(page, i * cls)).cast("B")
                 for i in range(HUGE_PAGE // cls)]
        for v in views[1:]:
            self.recycle(v)
        return views[0][:nbytes]

    def host_many(self, sizes: Sequence[int]) -> list[memoryview]:
        """:meth:`host` of each size, the pooled ones under one hold of the pool's lock (a batch of records:
        the lane's thread recycles buffers under that lock, so taking it per record contends with it)."""
        with self._lock:
            pooled = [self._pop(size_class(n)) for n in sizes]
        return [self.host(n) if b is None else b[:n] for n, b in zip(sizes, pooled)]

    def _pop(self, cls: int) -> memoryview | None:
        """An idle host buffer of class ``cls``, taken from the pool, or None. Lock held."""
        free = self._host.get(cls)
        if not free:
            return None
        self._host_bytes -= cls
        return free.pop()

    def record_buffer(self, nbytes: int, *, on_device: bool) -> tuple[Any, Any]:
        """A buffer for a record of ``nbytes`` and a 1-D uint8 array over it: a block-aligned device buffer
        (GDS moves those without a bounce), or a host buffer (:meth:`host`) and a numpy view."""
        if not on_device:
            buf = self.host(nbytes)
            return buf, np.frombuffer(buf, dtype=np.uint8)
        cls = size_class(nbytes)
        with self._lock:
            free = self._device.get(cls)
            whole = free.pop() if free else None
            if whole is not None:
                self._device_bytes -= cls
        if whole is None:
            import cupy

            raw = cupy.empty(cls + BLOCK, dtype=cupy.uint8)
            skip = -raw.data.ptr % BLOCK
            whole = raw[skip:skip + cls]
        buf = whole[:nbytes]
        with self._lock:
            self._owners[buf.data.ptr] = whole
        return buf, buf

    def recycle(self, buf: Any) -> None:
        """Take back a buffer :meth:`host` or :meth:`record_buffer` handed out (kept while there is room)."""
        if not isinstance(buf, memoryview):  # a device staging buffer
            with self._lock:
                whole = self._owners.pop(buf.data.ptr, None)
                if whole is None:
                    return
                cls = int(whole.nbytes)
                if self._device_bytes + cls <= self.limit:
                    self._device.setdefault(cls, []).append(whole)
                    self._device_bytes += cls
            return
        base = buf.obj
        if isinstance(base, mmap.mmap):
            view = memoryview(base)
        elif isinstance(base, ctypes.Array):
            view = memoryview(base).cast("B")
        else:
            return
        cls = len(view)
        with self._lock:
            if self._host_bytes + cls <= self.limit:
                self._host.setdefault(cls, []).append(view)
                self._host_bytes += cls
