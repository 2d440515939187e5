"""io_uring for the SSD tier: submission/completion rings over O_DIRECT shard files.

The tier drives io_uring itself: :class:`SysRing` makes the raw ``io_uring_setup``/``io_uring_enter``/
``io_uring_register`` system calls through ctypes and works on the mmap'ed rings (x86-64 and arm64 share
the syscall numbers). The ``liburing`` PyPI package is not used: its current prep calls take only
``bytes``/``bytearray`` and so cannot address our page-aligned buffers, its wheels are AVX-512 builds, and
the older release mis-reaps batches (docs/ssd.md, "I/O engines").

Primitives:

* :func:`aligned_buffer` -- page-aligned (optionally huge-page) mmap buffers, as O_DIRECT requires;
  :func:`buffer_address` -- the address the kernel is given, and the object that pins it.
* :class:`IoRing` -- a submission lane: prep reads/writes tagged with an integer, submit, reap or wait.
  :class:`EventfdRing` holds the waiting shared with the cuFile ring (``cufile.CuFileRing``).
* :class:`UringBackend` -- opens the shard files (O_DIRECT, preallocated) and hands out :class:`SysRing`
  rings; :class:`IoBackend` is the seam where the tests inject faults (``faults.FaultyBackend``).

Invariants:

* A buffer handed to a ring must stay alive and unmoved until its completion is reaped: the ring pins it
  by tag until then, and closing a ring first waits out everything in flight.
* Waiting for completions releases the GIL: it blocks in ``select`` on the ring's eventfd or in
  ``io_uring_enter`` (a ctypes call).
* The completion queue is always advanced over every entry seen, errors included, and a kernel overflow
  is flushed on every reap; otherwise the ring stalls.
* The SQ tail is published once per batch, after every SQE of it is written, right before
  ``io_uring_enter``.
* A ring is owned by one thread.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import struct
import time
from typing import Protocol

from ...errors import OrbitKVError


class SsdIoError(OrbitKVError):
    """The SSD tier cannot use its files or its I/O engine (O_DIRECT unsupported, io_uring disabled...)."""


#: Transparent huge page size (x86-64, arm64 with 4 KiB pages).
HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int, *, huge: bool = False) -> memoryview:
    """A zeroed, page-aligned, writable buffer of ``nbytes`` (rounded up to a page). ``huge``: rounded up
    to whole 2 MiB huge pages and advised ``MADV_HUGEPAGE``, so that the buffer is physically contiguous
    where the kernel can give huge pages: an O_DIRECT request over it is then a few large segments, not
    one 4 KiB segment per page (see ``SsdTier._staging``). Advice only: without huge pages it still works."""
    page = HUGE_PAGE if huge else mmap.PAGESIZE
    n = max(page, -(-nbytes // page) * page)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled in this kernel: 4 KiB pages
            pass
    return memoryview(m)


def buffer_address(buf: memoryview) -> tuple[int, object]:
    """Address of a writable buffer and the object that pins it (keep it until the I/O completed)."""
    pin = (ctypes.c_char * len(buf)).from_buffer(buf)
    return ctypes.addressof(pin), pin


class IoRing(Protocol):
    """A submission lane. Not thread-safe: one thread owns a ring."""

    eventfd: int

    def prep_write(self, fid: int, buf: memoryview, offset: int, tag: int) -> None: ...
    def prep_read(self, fid: int, buf: memoryview, offset: int, tag: int) -> None: ...
    def submit(self) -> None: ...
    def reap(self) -> list[tuple[int, int]]:
        """Every completion ready now as ``(tag, result)``; result is bytes moved or ``-errno``."""
    def wait(self, timeout: float | None) -> list[tuple[int, int]]:
        """Wait (GIL released) until at least one completion is ready or ``timeout`` passed; reap."""
    def submit_and_wait(self, timeout: float | None = None) -> list[tuple[int, int]]:
        """Submit what is prepped and wait for at least one completion (something must be in flight), at
        most ``timeout`` seconds (then ``[]``)."""
    def space(self) -> int:
        """Free submission slots."""
    def unsent(self) -> int:
        """Entries prepped and not yet submitted."""
    def submitted(self) -> int:
        """Entries submitted and not yet reaped."""
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ raw syscalls

_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427
_OP_READ, _OP_WRITE = 22, 23
_ENTER_GETEVENTS = 1
_ENTER_EXT_ARG = 1 << 3  # io_uring_enter's last two arguments are an io_uring_getevents_arg (Linux 5.11)
_FEAT_EXT_ARG = 1 << 8
_SQ_CQ_OVERFLOW = 1 << 1  # IORING_SQ_CQ_OVERFLOW in the SQ ring's flags
_REGISTER_EVENTFD = 4
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")
_U32 = struct.Struct("<I")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise SsdIoError(f"{what}: {os.strerror(e)} (errno {e})")
    return rc


class EventfdRing:
    """Completion waiting shared by the rings: each signals an eventfd when completions land, so a wait
    blocks in ``select`` (GIL released) and then reaps. Subclasses provide ``reap``, ``submit``,
    ``eventfd`` and ``_inflight``."""

    eventfd: int
    _inflight: int

    _unsubmitted: int

    def reap(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def submit(self) -> None:
        raise NotImplementedError

    def unsent(self) -> int:
        return self._unsubmitted

    def submitted(self) -> int:
        return self._inflight

    def wait(self, timeout: float | None) -> list[tuple[int, int]]:
        out = self.reap()
        if out or self._inflight == 0:
            return out
        select.select([self.eventfd], [], [], timeout)
        try:
            os.eventfd_read(self.eventfd)
        except BlockingIOError:
            pass
        return self.reap()

    def submit_and_wait(self, timeout: float | None = None) -> list[tuple[int, int]]:
        # Waits on the eventfd in select (GIL released): a driver's own blocking wait may hold the GIL.
        self.submit()
        return wait_any(self, timeout)


def wait_any(ring: "IoRing", timeout: float | None) -> list[tuple[int, int]]:
    """``ring.wait`` until at least one completion, or ``[]`` once ``timeout`` seconds passed (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        out = ring.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if out or (deadline is not None and time.monotonic() >= deadline):
            return out


class SysRing(EventfdRing):
    """io_uring through the raw system calls (see the module docstring)."""

    def __init__(self, entries: int, files: dict[int, int]) -> None:
        self._files = files
        params = (ctypes.c_uint8 * 120)()
        self.fd = _check(_libc.syscall(_SYS_SETUP, ctypes.c_uint(entries), params), "io_uring_setup")
        sq_entries, cq_entries = struct.unpack_from("<II", params, 0)
        self._ext_arg = bool(struct.unpack_from("<I", params, 20)[0] & _FEAT_EXT_ARG)
        # A wait's timeout (IORING_ENTER_EXT_ARG): a timespec and the io_uring_getevents_arg naming it
        # (sigmask, sigmask_sz and a pad, ts), made once; a wait only sets the timespec.
        self._ts = (ctypes.c_int64 * 2)()
        self._ext = (ctypes.c_uint64 * 3)(0, 0, ctypes.addressof(self._ts))
        self._ext_ref = ctypes.byref(self._ext)
        # A size_t, not a Python int: syscall() is variadic, and an int leaves the register's upper half
        # undefined (the kernel then sees another size and answers EINVAL).
        self._ext_size = ctypes.c_size_t(ctypes.sizeof(self._ext))
        (self._sq_head, self._sq_tail, sq_mask, _, self._sq_flags, _, sq_array) = struct.unpack_from("<7I", params, 40)
        (self._cq_head, self._cq_tail, cq_mask, _, _, cqes) = struct.unpack_from("<6I", params, 80)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._sq = mmap.mmap(self.fd, sq_array + sq_entries * 4, flags=flags, prot=prot, offset=_OFF_SQ_RING)
        self._cq = mmap.mmap(self.fd, cqes + cq_entries * 16, flags=flags, prot=prot, offset=_OFF_CQ_RING)
        self._sqes = mmap.mmap(self.fd, sq_entries * 64, flags=flags, prot=prot, offset=_OFF_SQES)
        self._sq_mask, self._cq_mask, self._cqes = _U32.unpack_from(self._sq, sq_mask)[0], _U32.unpack_from(self._cq, cq_mask)[0], cqes
        self._entries = sq_entries
        # SQE i always sits in slot i of the indirection array: filled once, never per submission.
        struct.pack_into(f"<{sq_entries}I", self._sq, sq_array, *range(sq_entries))
        self._tail = _U32.unpack_from(self._sq, self._sq_tail)[0]
        self._unsubmitted = 0
        self._inflight = 0
        self._pins: dict[int, object] = {}
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        efd = ctypes.c_int(self.eventfd)
        _check(_libc.syscall(_SYS_REGISTER, self.fd, _REGISTER_EVENTFD, ctypes.byref(efd), 1), "register eventfd")

    def space(self) -> int:
        return self._entries - self._inflight - self._unsubmitted

    def _prep(self, op: int, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        if self.space() <= 0:
            raise SsdIoError("submission queue full")
        addr, pin = buffer_address(buf)
        _SQE.pack_into(self._sqes, (self._tail & self._sq_mask) * 64, op, 0, 0, self._files[fid], offset, addr,
                       len(buf), 0, tag, 0, 0, 0, 0, 0)
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        self._pins[tag] = pin
        self._unsubmitted += 1

    def _publish(self) -> None:
        # The tail is published once per batch, right before io_uring_enter (without SQPOLL the kernel
        # reads it only there), after every SQE of the batch is written: the kernel must never see a tail
        # covering a half-written SQE (x86-64 keeps these plain stores in order; pack_into is a C call).
        _U32.pack_into(self._sq, self._sq_tail, self._tail)

    def prep_write(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prep(_OP_WRITE, fid, buf, offset, tag)

    def prep_read(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prep(_OP_READ, fid, buf, offset, tag)

    def submit(self) -> None:
        self._publish()
        while self._unsubmitted:
            n = _libc.syscall(_SYS_ENTER, self.fd, self._unsubmitted, 0, 0, None, 0)
            if n < 0:
                e = ctypes.get_errno()
                if e in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    # Transient: retry shortly. Completions are not reaped here (they would be lost to
                    # the caller); the ring never has more in flight than its completion queue holds.
                    time.sleep(0.0005)
                    continue
                raise SsdIoError(f"io_uring_enter: {os.strerror(e)}")
            self._unsubmitted -= n
            self._inflight += n

    def submit_and_wait(self, timeout: float | None = None) -> list[tuple[int, int]]:
        out = self.reap()
        if out:
            self.submit()
            return out
        # One io_uring_enter submits and blocks for a completion: a single GIL release per wait, which
        # matters for demand-read latency next to busy Python threads. A timeout rides along in the same
        # call (IORING_ENTER_EXT_ARG), so a read with a deadline pays no more system calls than one without.
        if timeout is not None and not self._ext_arg:  # a kernel before 5.11: the eventfd wait keeps the deadline
            return super().submit_and_wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        flags, arg, argsz = _ENTER_GETEVENTS, None, 0
        if timeout is not None:
            self._ts[0], self._ts[1] = int(timeout), int(timeout % 1 * 1e9)
            flags, arg, argsz = _ENTER_GETEVENTS | _ENTER_EXT_ARG, self._ext_ref, self._ext_size
        self._publish()
        while True:
            n = _libc.syscall(_SYS_ENTER, self.fd, self._unsubmitted, 1, flags, arg, argsz)
            if n >= 0:
                self._unsubmitted -= n
                self._inflight += n
                if self._unsubmitted == 0:
                    break
                continue
            e = ctypes.get_errno()
            if e == errno.ETIME:  # the timeout passed (IORING_ENTER_EXT_ARG)
                break
            if e not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise SsdIoError(f"io_uring_enter: {os.strerror(e)}")
            if self._unsubmitted == 0:
                break
        return self.reap() or self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def reap(self) -> list[tuple[int, int]]:
        if _U32.unpack_from(self._sq, self._sq_flags)[0] & _SQ_CQ_OVERFLOW:
            # Completions the kernel could not post wait on its overflow list, and every later one joins
            # them there, until an io_uring_enter with GETEVENTS flushes it: a reaper that only peeks at
            # the ring (the writeback lane) would otherwise wait for them forever.
            _libc.syscall(_SYS_ENTER, self.fd, 0, 0, _ENTER_GETEVENTS, None, 0)
        head = _U32.unpack_from(self._cq, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq, self._cq_tail)[0]
        out = []
        while head != tail:
            tag, res, _ = _CQE.unpack_from(self._cq, self._cqes + (head & self._cq_mask) * 16)
            out.append((tag, res))
            self._pins.pop(tag, None)
            head = (head + 1) & 0xFFFFFFFF
        # Always advance over everything seen, errors included, or the CQ fills and the ring stalls.
        _U32.pack_into(self._cq, self._cq_head, head)
        self._inflight -= len(out)
        return out

    def close(self) -> None:
        while self._inflight:  # buffers must outlive the kernel's use of them
            self.wait(1.0)
        for m in (self._sq, self._cq, self._sqes):
            m.close()
        os.close(self.fd)
        os.close(self.eventfd)


# ------------------------------------------------------------------------------------------ backend


class IoBackend(Protocol):
    """Opens shard files and makes rings; the seam where tests inject faults."""

    name: str

    def open(self, path: str, size: int, *, truncate: bool) -> int: ...
    def ring(self, entries: int) -> IoRing: ...
    def close(self) -> None: ...


class UringBackend:
    """O_DIRECT shard files driven through io_uring (:class:`SysRing`)."""

    name = "uring"

    def __init__(self) -> None:
        self._files: dict[int, int] = {}

    def open(self, path: str, size: int, *, truncate: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise SsdIoError(f"cannot open {path} with O_DIRECT: {e.strerror} (a tmpfs does not support "
                             "O_DIRECT; use a path on a real file system)") from None
        try:
            if truncate:
                os.ftruncate(fd, 0)
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            raise SsdIoError(f"cannot preallocate {size} bytes for {path}: {e.strerror}") from None
        fid = len(self._files)
        self._files[fid] = fd
        return fid

    def ring(self, entries: int) -> IoRing:
        return SysRing(entries, self._files)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
