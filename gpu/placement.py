"""Where a GPU worker puts a new batch in its workspace while one batch is still in flight there. Pure integer
arithmetic (no cupy, no numpy), so that the policy is tested on any machine.

Primitives: :func:`place_beside` (the new batch's offset, or None when it must wait), :func:`pair_bytes` (the
workspace a pair of batches needs side by side, what the workspace grows to when a pair did not fit).

Invariants: a placed extent ``[at, at + nbytes)`` lies within ``[0, size)``, does not overlap the batch in
flight and starts on an :data:`ALIGN` boundary; double-ended (below the batch in flight when it fits there,
else at the top of the workspace), so any two consecutive batches whose aligned sizes fit in the workspace
together run side by side, whatever their order of sizes.
"""

from __future__ import annotations

#: Batches start on this boundary within the workspace.
ALIGN = 1 << 16


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def place_beside(size: int, start: int, end: int, nbytes: int) -> int | None:
    """Offset of a new batch of ``nbytes`` in a workspace of ``size`` bytes whose extent ``[start, end)``
    holds the batch in flight: 0 when it fits below that batch, else the highest aligned offset that leaves
    it above; None when it fits neither way (the caller waits for the batch in flight)."""
    if nbytes <= start:
        return 0
    top = (size - nbytes) // ALIGN * ALIGN
    return top if top >= _up(end) else None


def pair_bytes(start: int, end: int, nbytes: int) -> int:
    """Workspace bytes that hold the batch at ``[start, end)`` and a new one of ``nbytes`` side by side."""
    return _up(end - start) + nbytes
