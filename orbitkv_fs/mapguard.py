"""Mappings of files another process owns, guarded against that process shrinking them (SIGBUS).

An engine's pages file belongs to the engine's OS user, which may truncate it at any time, with any
descriptor it holds open for writing: nothing in Linux stops it short of a sealed memfd, which would need the
descriptor passed over a Unix socket. A read or write of the Manager's mapping past the file's new end then
raises SIGBUS, whose default action ends the Manager, and every engine's cache with it: one ``ftruncate`` from
any local user that may register. The fault cannot be caught in Python: the interpreter's own handler returns
to the faulting instruction, which faults again.

So a SIGBUS handler of our own, compiled by numba (no C compiler needed) and installed with ``sigaction``
through ctypes, handles faults inside the ranges registered here: it maps a private zero page over the faulting
page (``mmap(MAP_FIXED | MAP_ANONYMOUS)``), counts the fault against its range, and returns, so the faulting
copy completes, with zeros read or its writes discarded. Faults anywhere else go to the handler that was there
before (Python's ``faulthandler``, or the default action) exactly as without this module.

Primitives: :func:`guard` (a range, and its fault count: :attr:`Guard.faults`), :meth:`Guard.release`,
:func:`unmap` (a guarded mapping closed, its guard released with it). Callers check :attr:`Guard.faults` after
each use of the mapping and treat anything read or written while it grew as lost. Invariants: the handler
touches only pages of ranges guarded now; a range stays guarded as long as its mapping exists (released once
it is unmapped, or when the last view of it goes); at most :data:`MAX_GUARDS` ranges are guarded at once (a registration
maps at most 8 pages files, and one OS user at most 256 engines; past the bound a registration is refused).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import signal
import sys
import threading
import weakref

import numpy as np

#: Ranges guarded at once, all engines together: as many as the kernel lets a process map by default
#: (``vm.max_map_count``, 65,530). The handler looks only at the slots up to the highest ever taken.
MAX_GUARDS = 65536
_PAGE = mmap.PAGESIZE
_SA_SIGINFO = 4
_SIGACTION_BYTES = 152  # glibc's struct sigaction on 64-bit Linux: handler, 128-byte mask, flags, restorer
_MAP_FIXED, _MAP_PRIVATE, _MAP_ANONYMOUS = 0x10, 0x02, 0x20

# Guard table, read by the handler: per slot (start, end, faults); start 0 = free. Never reallocated, so the
# handler may hold its address as a constant.
_table = np.zeros((MAX_GUARDS, 3), dtype=np.int64)
_high = np.zeros(1, dtype=np.int64)  # 1 + the highest slot ever taken: the handler's scan stops there
_previous = (ctypes.c_char * _SIGACTION_BYTES)()  # the action the handler passes foreign faults back to
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_ssize_t  # an address, or -1 (MAP_FAILED): compared as an integer in the handler
_sigaction = _libc.sigaction
_sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_sigaction.restype = ctypes.c_int
# Re-entrant: a guard whose mapping outlived its unmap is released by a weakref finalizer, which a collection may
# run inside guard()'s own locked section (at an allocation there), on the same thread.
_lock = threading.RLock()
_handler = None
_unavailable = ""  # why the handler could not be installed, once it could not
log = logging.getLogger("orbitkv_fs.mapguard")


def _compile():
    """The handler, compiled (about 0.5 s; numba is imported here, not with the module: engines import the
    pages module and never guard anything)."""
    import numba
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _pointer(typingctx, address):
        """An int64 as a ``void *`` (the table's and the saved action's addresses, fixed for the process)."""
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return types.voidptr(types.int64), codegen

    table_address, high_address = _table.ctypes.data, _high.ctypes.data
    previous_address = ctypes.addressof(_previous)
    sigbus, page = int(signal.SIGBUS), _PAGE
    mapping = _MAP_FIXED | _MAP_PRIVATE | _MAP_ANONYMOUS
    rw = mmap.PROT_READ | mmap.PROT_WRITE

    @numba.cfunc(types.void(types.int32, types.voidptr, types.voidptr), nopython=True)
    def handler(signum, info, context):
        # siginfo_t: si_signo, si_errno, si_code (ints), padding, then si_addr at byte 16 on 64-bit Linux
        address = numba.carray(info, 3, dtype=np.int64)[2]
        table = numba.carray(_pointer(table_address), (MAX_GUARDS, 3), dtype=np.int64)
        for i in range(numba.carray(_pointer(high_address), 1, dtype=np.int64)[0]):
            if table[i, 0] != 0 and table[i, 0] <= address < table[i, 1]:
                if _mmap(_pointer(address - address % page), page, rw, mapping, -1, 0) != -1:
                    table[i, 2] += 1
                    return
                break  # no page to be had (out of memory): faulting again would spin, so fall through
        # Not ours: the previous action takes over when the faulting instruction runs again.
        _sigaction(sigbus, _pointer(previous_address), _pointer(0))

    return handler


def _install() -> None:
    """Make the handler SIGBUS's action, unless it is already (someone may have installed theirs since:
    ``faulthandler.enable``); the action found is the one foreign faults go back to. Called with ``_lock``."""
    global _handler
    if _handler is None:
        _handler = _compile()
    current = (ctypes.c_char * _SIGACTION_BYTES)()
    if _sigaction(signal.SIGBUS, None, current) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) could not be read")
    if ctypes.c_void_p.from_buffer(current).value == _handler.address:
        return
    action = (ctypes.c_char * _SIGACTION_BYTES)()
    ctypes.c_void_p.from_buffer(action).value = _handler.address
    ctypes.c_int.from_buffer(action, 8 + 128).value = _SA_SIGINFO
    ctypes.memmove(_previous, current, _SIGACTION_BYTES)
    if _sigaction(signal.SIGBUS, action, None) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) could not be set")


class Guard:
    """One guarded range: faults inside it are survived and counted."""

    __slots__ = ("slot", "start", "end")

    def __init__(self, slot: int, start: int, end: int) -> None:
        self.slot, self.start, self.end = slot, start, end

    @property
    def faults(self) -> int:
        """Faults inside the range since it was guarded (nonzero: the file shrank under the mapping)."""
        return int(_table[self.slot, 2]) if self.slot >= 0 else 0

    def release(self) -> None:
        """Stop guarding the range (before it is unmapped)."""
        if self.slot >= 0:
            with _lock:
                _table[self.slot] = 0
            self.slot = -1


def guard(address: int, length: int) -> Guard:
    """Guard ``length`` bytes of a mapping at ``address``. Raises ``OverflowError`` when :data:`MAX_GUARDS`
    ranges are guarded already. Where the handler cannot be had (not Linux, numba failing to compile it) the
    answer guards nothing (its :attr:`~Guard.faults` stay 0), and that is logged once: the mapping is as
    exposed as it was before this module."""
    global _unavailable
    with _lock:
        if _unavailable:
            return Guard(-1, address, address + length)
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("the handler is written for Linux's siginfo_t and glibc's struct sigaction")
            _install()
        except Exception as e:  # noqa: BLE001 - any failure leaves the mapping as it was before guards
            _unavailable = f"{type(e).__name__}: {e}"
            log.warning("mappings of engines' pages files are not guarded (%s): an engine that shrinks its pages "
                        "file ends this process with SIGBUS", _unavailable)
            return Guard(-1, address, address + length)
        high = int(_high[0])
        free = np.flatnonzero(_table[:high, 0] == 0)
        slot = int(free[0]) if len(free) else high
        if slot >= MAX_GUARDS:
            raise OverflowError(f"{MAX_GUARDS} mappings are guarded already")
        _table[slot, 1:] = address + length, 0
        _table[slot, 0] = address  # then the start: the handler reads a slot as live from it
        _high[0] = max(int(_high[0]), slot + 1)  # last: the slot is whole when the scan reaches it
    return Guard(slot, address, address + length)


def unmap(mm: mmap.mmap, guard: Guard | None) -> None:
    """Close ``mm`` and release its ``guard`` (None: it has none). Where views of it are still alive elsewhere,
    the mapping stays until they go, and so does the guard."""
    try:
        mm.close()
    except BufferError:
        if guard is not None:
            weakref.finalize(mm, guard.release)
        return
    if guard is not None:
        guard.release()
