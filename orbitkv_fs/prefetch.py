"""Software prefetch for numba loops that touch one cache line per segment across the arena.

A batch's segment headers lie 512 KiB or more apart in the arena: each is a line on a page of its own, which
the CPU has neither cached nor mapped in its TLB. A loop that writes or reads them one after another waits
for each miss in turn (about 100-400 ns each). Asking for every line first lets the misses overlap. A save
flight's header writes took 54 -> 26 us for 230 headers, and with cold lines 105 -> 52 us
(docs/results/2026-12-03-gpu-suite).

Primitives: :func:`prefetch_lines` (in numba code: the line at ``base + at[j]`` for every ``j``).

Invariants: a prefetch is a hint. It never faults, whatever the address, and never changes a byte, so a
caller's correctness never depends on it. Needs numba and llvmlite only.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


@intrinsic
def _prefetch(typingctx, addr, write):
    """``llvm.prefetch`` of the line at address ``addr`` (int64), for a write when ``write`` (a literal int)
    is 1, else for a read; kept in every cache level."""
    if not isinstance(write, types.IntegerLiteral):
        return None
    rw = int(write.literal_value)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]))
        builder.call(fn, [builder.inttoptr(args[0], _I8P), ir.Constant(_I32, rw), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64, write), codegen


@numba.njit(inline="always")
def prefetch_lines(base: int, at: np.ndarray, write: bool) -> None:
    """Prefetch the cache line at address ``base + at[j]`` for each ``j`` (for writing when ``write``)."""
    if write:
        for j in range(at.shape[0]):
            _prefetch(base + at[j], 1)
    else:
        for j in range(at.shape[0]):
            _prefetch(base + at[j], 0)
