"""An in-memory I/O backend for the SSD tier's benchmarks: the tier's ring interface over ``bytearray``
"files", completing every operation at ``submit``. With it, a benchmark measures the tier's own work per
record (and the Manager's around it) without the device: what code changes cost, not what the disk does."""

from __future__ import annotations

import os
from typing import Any


class MemRing:
    """The tier's ring interface over in-memory files: a prepped write copies into the file, a read copies
    out; every operation completes at ``submit``."""

    def __init__(self, entries: int, files: dict[int, bytearray]) -> None:
        self._files, self._entries = files, entries
        self._prepped: list[tuple[bool, int, Any, int, int]] = []
        self._done: list[tuple[int, int]] = []
        self._inflight = 0
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def space(self) -> int:
        return self._entries - self._inflight - len(self._prepped)

    def unsent(self) -> int:
        return len(self._prepped)

    def submitted(self) -> int:
        return self._inflight

    def prep_write(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prepped.append((True, fid, buf, offset, tag))

    def prep_read(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prepped.append((False, fid, buf, offset, tag))

    def submit(self) -> None:
        for write, fid, buf, offset, tag in self._prepped:
            f = self._files[fid]
            n = len(buf)
            if write:
                f[offset:offset + n] = buf
            else:
                buf[:n] = f[offset:offset + n]
            self._done.append((tag, n))
        self._inflight += len(self._prepped)
        self._prepped.clear()
        os.eventfd_write(self.eventfd, 1)

    def reap(self) -> list[tuple[int, int]]:
        out, self._done = self._done, []
        self._inflight -= len(out)
        return out

    def wait(self, timeout: float | None) -> list[tuple[int, int]]:
        return self.reap()

    def submit_and_wait(self) -> list[tuple[int, int]]:
        self.submit()
        return self.reap()

    def close(self) -> None:
        os.close(self.eventfd)


class MemBackend:
    name = "mem"

    def __init__(self) -> None:
        self._files: dict[int, bytearray] = {}

    def open(self, path: str, size: int, *, truncate: bool) -> int:
        fid = len(self._files)
        self._files[fid] = bytearray(size)
        return fid

    def ring(self, entries: int) -> MemRing:
        return MemRing(entries, self._files)

    def close(self) -> None:
        self._files.clear()
