"""Fault injection for the SSD tier's I/O layer (tests and qualification only).

:class:`FaultyBackend` wraps a real :class:`~orbitkv_fs.tiers.ssd.uring.IoBackend`; its rings pass every
operation to the real ring except those a :class:`Faults` plan claims: those complete with an injected
``-errno`` without touching the disk, and completions can be held back for a while (a slow lane). The real
files and the real io_uring stay underneath, so everything not injected behaves exactly as in production.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from .uring import IoBackend, IoRing, wait_any


@dataclass
class Faults:
    """A mutable plan; tests change it while the tier runs. Counts of -1 mean "every operation"."""

    write_errno: int = 0
    write_errors: int = 0
    read_errno: int = 0
    read_errors: int = 0
    write_delay: float = 0.0  # seconds each write completion is held back
    read_delay: float = 0.0
    injected: dict[str, int] = field(default_factory=lambda: {"write": 0, "read": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, kind: str) -> int:
        """The -errno to inject into the next ``kind`` operation, or 0."""
        with self._lock:
            n = getattr(self, f"{kind}_errors")
            if n == 0:
                return 0
            if n > 0:
                setattr(self, f"{kind}_errors", n - 1)
            self.injected[kind] += 1
            return -getattr(self, f"{kind}_errno")


class FaultyRing:
    def __init__(self, inner: IoRing, faults: Faults) -> None:
        self._inner = inner
        self._faults = faults
        self._kind: dict[int, str] = {}
        self._ready: list[tuple[float, int, int]] = []  # (release time, tag, result)
        self.eventfd = inner.eventfd

    def space(self) -> int:
        return self._inner.space() - len(self._ready)

    def _prep(self, kind: str, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        err = self._faults.take(kind)
        if err:
            self._hold(tag, err, kind)
            return
        self._kind[tag] = kind
        getattr(self._inner, f"prep_{kind}")(fid, buf, offset, tag)

    def prep_write(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prep("write", fid, buf, offset, tag)

    def prep_read(self, fid: int, buf: memoryview, offset: int, tag: int) -> None:
        self._prep("read", fid, buf, offset, tag)

    def _hold(self, tag: int, res: int, kind: str) -> None:
        delay = getattr(self._faults, f"{kind}_delay")
        self._ready.append((time.monotonic() + delay, tag, res))
        # Wake whoever waits on the eventfd when the held completion becomes visible.
        if delay > 0:
            t = threading.Timer(delay, self._signal)
            t.daemon = True
            t.start()
        else:
            os.eventfd_write(self.eventfd, 1)

    def _signal(self) -> None:
        try:
            os.eventfd_write(self.eventfd, 1)
        except OSError:  # the ring closed meanwhile
            pass

    def unsent(self) -> int:
        return self._inner.unsent()

    def submitted(self) -> int:
        return self._inner.submitted()

    def submit(self) -> None:
        self._inner.submit()

    def _absorb(self, done: list[tuple[int, int]]) -> None:
        for tag, res in done:
            self._hold(tag, res, self._kind.pop(tag, "write"))

    def reap(self) -> list[tuple[int, int]]:
        self._absorb(self._inner.reap())
        now = time.monotonic()
        out = [(tag, res) for t, tag, res in self._ready if t <= now]
        self._ready = [r for r in self._ready if r[0] > now]
        return out

    def wait(self, timeout: float | None) -> list[tuple[int, int]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self.reap()
            if out or (not self._ready and not self._kind):
                return out
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return out
            if self._kind:
                self._absorb(self._inner.wait(min(left, 0.01) if left is not None else 0.01))
            else:
                time.sleep(0.002)

    def submit_and_wait(self, timeout: float | None = None) -> list[tuple[int, int]]:
        self.submit()
        return wait_any(self, timeout)

    def close(self) -> None:
        while self._ready or self._kind:
            self.wait(1.0)
        self._inner.close()


class FaultyBackend:
    def __init__(self, inner: IoBackend, faults: Faults) -> None:
        self._inner = inner
        self.faults = faults
        self.name = f"faulty-{inner.name}"

    def open(self, path: str, size: int, *, truncate: bool) -> int:
        return self._inner.open(path, size, truncate=truncate)

    def ring(self, entries: int) -> FaultyRing:
        return FaultyRing(self._inner.ring(entries), self.faults)

    def close(self) -> None:
        self._inner.close()
