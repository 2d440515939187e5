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


def open_tier(config: SsdConfig, *, stall: float,
              on_progress: Callable[[int, int], None] | None = None) -> SsdTier:
    """``SsdTier(config, on_progress=on_progress)``, made on a thread of its own; raises
    :class:`SsdStartStalled` once it has shown no progress for ``stall`` seconds (the thread is left to the
    kernel, and closes the tier should it finish), and what the start raised otherwise."""
    lock = threading.Lock()
    state: dict = {"moved": time.monotonic(), "abandoned": False}

    def report(done: int, total: int) -> None:
        state["moved"] = time.monotonic()
        if on_progress is not None:
            on_progress(done, total)

    def start() -> None:
        try:
            tier = SsdTier(config, on_progress=report)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            with lock:
                state["error"] = e
                late = state["abandoned"]
            if late:
                log.warning("the SSD tier's start over %s, given up, failed once the disk answered: %s",
                            ", ".join(config.paths), e)
            return
        with lock:
            keep = not state["abandoned"]
            if keep:
                state["tier"] = tier
        if not keep:
            log.warning("the SSD tier's start over %s finished after it was given up: closed; restart the "
                        "Manager to use it", ", ".join(config.paths))
            tier.close()

    th = threading.Thread(target=start, name="orbitkv-ssd-start", daemon=True)
    th.start()
    cpu = _thread_cpu(th.ident)
    while True:
        th.join(_POLL_S)
        if not th.is_alive():
            break
        now_cpu = _thread_cpu(th.ident)
        if now_cpu - cpu >= _BUSY_S:
            state["moved"], cpu = time.monotonic(), now_cpu
        if time.monotonic() - state["moved"] >= stall:
            with lock:
                if "tier" in state or "error" in state:  # it finished just now
                    break
                state["abandoned"] = True
            raise SsdStartStalled(
                f"the SSD tier's start over {', '.join(config.paths)} made no progress for {stall:g} s: a disk "
                "that does not answer (its thread stays with the kernel until it does)")
    if "error" in state:
        raise state["error"]
    return state["tier"]
