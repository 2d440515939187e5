"""Progress bars for long runs of the command-line tools (and of anything else that scans or copies a lot).

Owns :func:`progress`, the one way OrbitKV-FS shows progress: ``with progress(total, "scanning", "B") as
bar: ... bar.update(n)`` (or ``bar.update_to(done)`` where a callback reports a position, as
:func:`orbitkv_fs.tiers.ssd.record.scan` does; ``bar.write(line)`` prints a line on stderr without tearing
the bar). The bar is tqdm's, drawn on stderr.

Invariants: a bar is drawn only where a person watches: on a terminal (stderr is a TTY), or when
``ORBITKV_PROGRESS=1`` asks for it (``ORBITKV_PROGRESS=0`` turns every bar off); anywhere else (a pipe, a
log file, CI, a server's log) the returned object does nothing and tqdm is not even imported. On a
terminal a bar appears only once its work has run ``delay`` seconds (default 2), so quick runs print
nothing; asked for with ``ORBITKV_PROGRESS=1`` it is drawn from the start. Counting never changes what the
caller computes; stdout is never written.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

__all__ = ["Progress", "progress"]

#: Environment switch: "1" draws bars even without a terminal, "0" never draws them.
ENV = "ORBITKV_PROGRESS"


class Progress:
    """A progress bar, or nothing (:func:`progress` decides). Use it as a context manager or ``close`` it."""

    def __init__(self, bar: Any = None) -> None:
        self._bar = bar
        self._done = 0

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        self._done += n
        if self._bar is not None:
            self._bar.update(n)

    def update_to(self, done: int, total: int | None = None) -> None:
        """``done`` units done in all (for callbacks that report a position, not an increment); ``total``
        sets the total once a callback knows it."""
        if total is not None and self._bar is not None and self._bar.total != total:
            self._bar.total = total
            self._bar.refresh()
        if done > self._done:
            self.update(done - self._done)

    def write(self, line: str) -> None:
        """Print ``line`` on stderr above the bar (a plain print would tear the bar apart)."""
        if self._bar is not None:
            self._bar.write(line, file=self._bar.fp)
        else:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _switch() -> bool | None:
    value = os.environ.get(ENV, "").strip()
    return value == "1" if value in ("0", "1") else None


def _is_tty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def progress(total: int | None, desc: str, unit: str = "it", *, enabled: bool | None = None,
             delay: float = 2.0, file: TextIO | None = None) -> Progress:
    """A bar counting ``total`` units (None: unknown) of ``desc``. ``unit="B"`` counts bytes and shows
    KiB/MiB/GiB. ``enabled`` overrides the terminal test (and ``ORBITKV_PROGRESS``)."""
    out = file if file is not None else sys.stderr
    forced = _switch() if enabled is None else enabled
    if not (_is_tty(out) if forced is None else forced):
        return Progress()
    if forced:
        delay = 0.0
    from tqdm import tqdm

    size = unit == "B"
    return Progress(tqdm(total=total, desc=desc, unit=unit, unit_scale=size, unit_divisor=1024 if size else 1000,
                         delay=delay, file=out, leave=True, dynamic_ncols=True))
