"""The GPU kernels' descriptor rows (``module.SEG_DTYPE``, 128 bytes each), written by numba a kernel group at a
time: one call per group of a batch instead of a numpy pass per field (a score of them per group, on a few
hundred rows, cost the host more than the rest of a batch's descriptors).

Primitives: :func:`encode_group` (a group of an encode batch: FP8, TurboQuant, ANS packing, the CRC32C pass
and copy), :func:`decode_group` (of a decode batch: the CRC32C check, FP8, TurboQuant, the checked copy),
:func:`decode_addresses` (a planned decode flight's rows: a copy of its plan's with the flight's addresses),
:func:`mirror` (a decode flight's payload staging, runs of neighbours in pinned memory kept together).

Invariants: the rows are the ones the engine's field-by-field reference builds (tests/test_gpu_descriptors.py);
a group's rows are consecutive from ``r0`` in the batch's row array, given as its ``(rows, 16)`` uint64 view
``q`` and ``(rows, 32)`` uint32 view ``w`` of zeroed memory (fields a row does not use stay zero); each row's
work units and their running start within the group are set here, and the group's units are answered. Needs
numpy and numba only (no cupy).
"""

from __future__ import annotations

import numba
import numpy as np

# SEG_DTYPE's fields as columns of the (rows, 16) uint64 view (Q_*) and the (rows, 32) uint32 view (W_*)
Q_SRC, Q_DST, Q_N, Q_N_DEV, Q_ST_DEV = 0, 1, 2, 3, 12
W_BLOCK0, W_NBLOCKS, W_META, W_DTYPE, W_HEAD_DIM, W_BITS, W_ROLE, W_EXPECT, W_SIGNS = 8, 9, 10, 11, 12, 13, 14, 15, 16

# kernel groups of an encode batch ...
ENC_FP8, ENC_TQ, ENC_ANS, ENC_CHECK = 0, 1, 2, 3
# ... and of a decode batch
DEC_CHECK, DEC_FP8, DEC_TQ, DEC_COPY = 0, 1, 2, 3


@numba.njit(inline="always")
def _tq_row(q: np.ndarray, w: np.ndarray, r: int, j: int, n: int, src: int, hd: int, bits: int, role: int,
            signs: np.ndarray, tq_vectors: int) -> int:
    """A TurboQuant row's own fields (encode or decode of ``n`` source bytes, vectors of ``hd``, the group's
    j-th sign words); answers its work units (a decode header's zero head dim counts as one)."""
    q[r, Q_SRC] = src
    w[r, W_HEAD_DIM] = hd
    w[r, W_BITS] = bits
    w[r, W_ROLE] = role
    for b in range(8):
        w[r, W_SIGNS + b] = signs[j, b]
    per = tq_vectors // max(hd, 1)
    return (n // max(2 * hd, 1) + per - 1) // per


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode_group(q: np.ndarray, w: np.ndarray, r0: int, code: int, sel: np.ndarray, raw: np.ndarray,
                 ptr: np.ndarray, slot: np.ndarray, n: np.ndarray, cap: np.ndarray, fp16: np.ndarray,
                 head_dim: np.ndarray, bits: np.ndarray, role: np.ndarray, nch: np.ndarray, chunk0: np.ndarray,
                 tmp: np.ndarray, signs: np.ndarray, payload0: int, chunk_cap: int, tmp0: int, pay0: int,
                 sizes0: int, status0: int, unit: int, tq_vectors: int) -> int:
    """Rows ``r0..`` of the encode group ``code`` over the batch's segments ``sel`` (indices into the column
    arrays, each a segment's value): a segment's payload goes to ``payload0 + slot``; TurboQuant rows take
    ``signs[j]`` (the j-th of the group's sign words); ANS packing rows read the chunk outputs at ``tmp0 +
    tmp``, the chunk sizes and statuses at ``sizes0`` / ``status0`` (8 and 4 bytes per chunk from ``chunk0``)
    and write the j-th payload length at ``pay0 + 8 j``; CRC32C rows copy a ``raw`` segment into its slot
    (checked on the way), else check the payload where it lies (``cap`` bytes). Work units: ``unit`` bytes,
    ``tq_vectors / head_dim`` TurboQuant vectors, an ANS segment's chunks."""
    block = 0
    for j in range(len(sel)):
        i = sel[j]
        r = r0 + j
        dst = payload0 + slot[i]
        w[r, W_META] = i
        q[r, Q_N] = n[i]
        if code == ENC_FP8:
            nb = (n[i] // 2 + unit - 1) // unit
            q[r, Q_SRC] = ptr[i]
            q[r, Q_DST] = dst
            w[r, W_DTYPE] = fp16[i]
        elif code == ENC_TQ:
            nb = _tq_row(q, w, r, j, n[i], ptr[i], head_dim[i], bits[i], role[i], signs, tq_vectors)
            q[r, Q_DST] = dst
            w[r, W_DTYPE] = fp16[i]
        elif code == ENC_ANS:
            nb = nch[i]
            pay = pay0 + 8 * j
            q[r, Q_SRC] = tmp0 + tmp[i]
            q[r, Q_DST] = dst
            q[r, Q_N_DEV] = sizes0 + 8 * chunk0[i]
            q[r, Q_ST_DEV] = status0 + 4 * chunk0[i]
            w[r, W_BITS] = cap[i]
            w[r, W_EXPECT] = chunk_cap
            w[r, W_SIGNS] = pay & 0xFFFFFFFF
            w[r, W_SIGNS + 1] = pay >> 32
        else:  # ENC_CHECK
            if raw[i]:
                size = n[i]
                q[r, Q_SRC] = ptr[i]
                q[r, Q_DST] = dst
            else:
                size = cap[i]
                q[r, Q_SRC] = dst
            q[r, Q_N] = size
            nb = (size + unit - 1) // unit
        w[r, W_NBLOCKS] = nb
        w[r, W_BLOCK0] = block
        block += nb
    return block


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_group(q: np.ndarray, w: np.ndarray, r0: int, code: int, sel: np.ndarray, ans: np.ndarray,
                 src: np.ndarray, dst: np.ndarray, stored: np.ndarray, orig: np.ndarray, fp16: np.ndarray,
                 head_dim: np.ndarray, bits: np.ndarray, role: np.ndarray, expect: np.ndarray,
                 scratch: np.ndarray, chunk0: np.ndarray, signs: np.ndarray, actual: int, status: int, unit: int,
                 tq_vectors: int, ans_chunk: int) -> int:
    """Rows ``r0..`` of the decode group ``code`` over the batch's segments ``sel``: CRC32C checks of the
    payloads at ``src`` (``stored`` bytes, against ``expect``); decodes of ``orig`` bytes into ``dst``
    (TurboQuant with ``signs[j]``); checked copies from the payload (raw) or from its decompressed bytes at
    ``scratch`` (``ans``), checked against nvCOMP's sizes and statuses at ``actual`` / ``status`` (8 and 4
    bytes per chunk from ``chunk0``, ``ans_chunk`` bytes a chunk). Work units as :func:`encode_group`."""
    block = 0
    for j in range(len(sel)):
        i = sel[j]
        r = r0 + j
        w[r, W_META] = i
        w[r, W_EXPECT] = expect[i]
        if code == DEC_CHECK:
            q[r, Q_N] = stored[i]
            q[r, Q_SRC] = src[i]
            nb = (stored[i] + unit - 1) // unit
        else:
            o = orig[i]
            q[r, Q_N] = o
            q[r, Q_DST] = dst[i]
            w[r, W_DTYPE] = fp16[i]
            if code == DEC_FP8:
                q[r, Q_SRC] = src[i]
                nb = (o // 2 + unit - 1) // unit
            elif code == DEC_TQ:
                nb = _tq_row(q, w, r, j, o, src[i], head_dim[i], bits[i], role[i], signs, tq_vectors)
            else:  # DEC_COPY
                if ans[i]:
                    q[r, Q_SRC] = scratch[i]
                    q[r, Q_N_DEV] = actual + 8 * chunk0[i]
                    q[r, Q_ST_DEV] = status + 4 * chunk0[i]
                    w[r, W_HEAD_DIM] = ans_chunk
                else:
                    q[r, Q_SRC] = src[i]
                nb = (o + unit - 1) // unit
        w[r, W_NBLOCKS] = nb
        w[r, W_BLOCK0] = block
        block += nb
    return block


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_addresses(q: np.ndarray, w: np.ndarray, plan: np.ndarray, check: int, src: np.ndarray, dst: np.ndarray,
                     expect: np.ndarray) -> None:
    """The rows of a decode flight without ANS segments from its plan's rows ``plan`` (what :func:`decode_group`
    wrote for segments of the same headers but for their CRCs): each row's segment ``i`` (its ``W_META``) reads
    its payload at ``src[i]``, and is checked against ``expect[i]``; rows from ``check`` on (the decodes and
    copies, after the CRC32C pass) write ``dst[i]``."""
    for r in range(plan.shape[0]):
        for c in range(plan.shape[1]):
            q[r, c] = plan[r, c]
        i = w[r, W_META]
        q[r, Q_SRC] = src[i]
        if r >= check:
            q[r, Q_DST] = dst[i]
        w[r, W_EXPECT] = expect[i]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def mirror(host: np.ndarray, stored: np.ndarray, end: int, align: int, gap: int,
           staged: np.ndarray, starts: np.ndarray) -> tuple[int, int]:
    """Staging offsets of payloads at pinned host addresses ``host`` (``stored`` bytes each), from ``end`` on:
    a payload that follows the previous one there (a step that is a multiple of ``align``, at most ``gap``
    bytes after its end) keeps its offset from it, so that the run goes up in one copy; another starts at the
    next multiple of ``align``. Writes ``staged`` and the runs' first rows into ``starts``; answers the number
    of runs and the staging's end."""
    runs = 0
    for i in range(len(host)):
        d = host[i] - host[i - 1] if i else 0
        if i and d % align == 0 and 0 <= d - stored[i - 1] <= gap:
            staged[i] = staged[i - 1] + d
        else:
            staged[i] = (end + align - 1) // align * align
            starts[runs] = i
            runs += 1
        end = staged[i] + stored[i]
    return runs, end
