"""Test helper: the GPU engine's save Worker's batches in flight, with no CUDA behind them (tests that record
what the engine sends need cupy importable, not a GPU)."""

from __future__ import annotations


class InFlight:
    """A flight finishes when the engine asks (collect), or when a third one wants room (as ``Worker.place``:
    two in flight at most). Subclasses keep ``self.inflight`` and call :meth:`make_room` in ``place`` and
    :meth:`track` in ``launched``."""

    inflight: list

    def make_room(self) -> None:
        while len(self.inflight) > 1:
            self.finish(self.inflight[0])

    def track(self, f):
        self.inflight.append(f)
        return f

    def finish(self, f) -> None:
        if f in self.inflight:
            self.inflight.remove(f)
            f.finish()

    def drop(self, flights) -> None:
        for f in flights:
            if f in self.inflight:
                self.inflight.remove(f)
