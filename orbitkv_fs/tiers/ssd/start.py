"""Starting the SSD tier without waiting on a disk that does not answer.

Primitives: :func:`open_tier` (an :class:`~.tier.SsdTier` made on a thread of its own and watched) and
:class:`SsdStartStalled` (what it raises when the start stopped moving).

A tier's start opens its shard files and, with ``recover``, reads each one through (``pread``, 8 MiB at a
time). On a disk that stopped answering, one of those calls waits in the kernel for as long as the disk does:
before this, ``orbitkv-cache-manager --ssd-recover`` never became ready, DRAM included, and SIGTERM did not
stop it.

Invariants: the caller waits at most ``stall`` seconds past the start's last sign of progress: a report of the
recovery scan, or CPU time of the starting thread (adopting a large index is slow but busy, a thread held by the
kernel is neither); a start given up on never serves: the tier it finishes later, if the disk answers, is
closed by its own thread at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .tier import SsdConfig, SsdTier
from .uring import SsdIoError

log = logging.getLogger(__name__)

#: How often the watcher looks at the start's progress.
_POLL_S = 0.5
#: CPU seconds of the starting thread, within ``stall``, that count as progress.
_BUSY_S = 0.05


class SsdStartStalled(SsdIoError):
    """The SSD tier's start made no progress for the allowed time: a shard's disk does not answer."""


def _thread_cpu(ident: int | None) -> float:
    """CPU seconds of the thread ``ident`` so far (0 where the platform does not say)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))  # type: ignore[arg-type]
    except (AttributeError, OSError, OverflowError, TypeError):
        return 0.0


class _Start:
    """One watched start: made on its own thread (:meth:`run`), its progress (:meth:`report`), its outcome."""

    def __init__(self, config: SsdConfig, on_progress: Callable[[int, int], None] | None) -> None:
        self.config, self.on_progress = config, on_progress
        self.lock = threading.Lock()
        self.moved = time.monotonic()  # the last sign of progress
        self.abandoned = self.done = False
        self.tier: SsdTier | None = None
        self.error: BaseException | None = None

    def report(self, done: int, total: int) -> None:
        self.moved = time.monotonic()
        if self.on_progress is not None:
            self.on_progress(done, total)

    def run(self) -> None:
        paths = ", ".join(self.config.paths)
        tier = error = None
        try:
            tier = SsdTier(self.config, on_progress=self.report)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            error = e
        with self.lock:
            self.tier, self.error, self.done = tier, error, True
            late = self.abandoned
        if late and error is not None:
            log.warning("the SSD tier's start over %s, given up, failed once the disk answered: %s", paths, error)
        elif late:
            log.warning("the SSD tier's start over %s finished after it was given up: closed; restart the "
                        "Manager to use it", paths)
            tier.close()


def open_tier(config: SsdConfig, *, stall: float,
              on_progress: Callable[[int, int], None] | None = None) -> SsdTier:
    """``SsdTier(config, on_progress=on_progress)``, made on a thread of its own; raises
    :class:`SsdStartStalled` once it has shown no progress for ``stall`` seconds (the thread is left to the
    kernel, and closes the tier should it finish), and what the start raised otherwise."""
    st = _Start(config, on_progress)
    th = threading.Thread(target=st.run, name="orbitkv-ssd-start", daemon=True)
    th.start()
    cpu = _thread_cpu(th.ident)
    while True:
        th.join(_POLL_S)
        if not th.is_alive():
            break
        now_cpu = _thread_cpu(th.ident)
        if now_cpu - cpu >= _BUSY_S:
            st.moved, cpu = time.monotonic(), now_cpu
        if time.monotonic() - st.moved >= stall:
            with st.lock:
                if st.done:  # it finished just now
                    break
                st.abandoned = True
            raise SsdStartStalled(
                f"the SSD tier's start over {', '.join(config.paths)} made no progress for {stall:g} s: a disk "
                "that does not answer (its thread stays with the kernel until it does)")
    if st.error is not None:
        raise st.error
    assert st.tier is not None
    return st.tier
