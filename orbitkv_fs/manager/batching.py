"""How the pipelines cut work into codec batches and overlap them.

Primitives: :meth:`Batching._codec_batches` (at most ``batch_segments`` segments, the codec budget in
workspace bytes, ``BATCH_EXPANSION`` budgets of source bytes), :meth:`Batching._run_batches` (the same cut
of items that come in runs with their cumulative sizes, a save's chunks: each batch as slices of the runs),
:meth:`Batching._batch_budget` (half the
budget with the GPU engine: two batches share its workspace), :func:`_pipelined` (batch i+1 started before
batch i ends), :func:`_coded_bound` / :func:`_decode_bound` (the workspace a segment takes).

Invariants: a batch never passes the budget unless one segment alone does; :func:`_pipelined` ends every
item it started, also when one fails.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from ..codecs import Codec
from ..segment import TURBOQUANT_HEAD_DIMS, Format, Role, SegmentHeader, turboquant_stored_bytes

if TYPE_CHECKING:
    from .registry import _Seg


#: A codec batch's source (save) or decoded (restore) bytes are at most this many times its workspace
#: share: the gathered sources and decoded temporaries live outside the workspace, and stay bounded.
BATCH_EXPANSION = 4


def _coded_bound(seg: _Seg, n: int) -> int:
    """Workspace bytes the GPU engine's encode of ``n`` source bytes of ``seg`` takes: its payload slot,
    as :meth:`orbitkv_fs.gpu.engine.GpuCodecEngine._classify` sizes it (ANS and raw: the source size)."""
    codec = seg.codec_name
    d = seg.block_shape[-1] if seg.block_shape else 0
    if codec == "fp8" and seg.dtype.itemsize == 2:
        return n // 2
    if (codec.startswith("turboquant") and seg.dtype.itemsize == 2 and seg.role in (Role.KEY, Role.VALUE)
            and d in TURBOQUANT_HEAD_DIMS):
        return turboquant_stored_bytes(n, d, int(codec[-1]), seg.role)
    return n


def _decode_bound(h: SegmentHeader) -> int:
    """The bytes a restore batch counts for a segment with header ``h``: its payload (the workspace it is
    staged in); for ANS its decoded size, as before: the engine's workspace also holds nvCOMP's output, and
    the engine splits such a batch into flights itself (batches sized by payload plus output restored
    ANS 4 MiB segments 9-26% slower, docs/results/2026-11-30-pipeline-gpu-6)."""
    return h.original_length if h.format == Format.ANS else h.stored_length


def _pipelined(items: Iterable, start: Callable, end: Callable) -> list:
    """``end(start(item))`` for each item, in order, two at a time: item i+1 is started before item i is
    ended, so that one item's host work overlaps the other's device work. On an error every started item
    is still ended (an error there is dropped: the first one is raised). Answers the ``end`` results."""
    out: list = []
    pending = None
    try:
        for item in items:
            # The new item is pending before the previous one ends: should that end fail, it is ended too.
            done, pending = pending, start(item)
            if done is not None:
                out.append(end(done))
        if pending is not None:
            done, pending = pending, None
            out.append(end(done))
    except BaseException:
        if pending is not None:
            try:
                end(pending)
            except Exception:
                pass
        raise
    return out


class Batching:
    """Codec batches of the save and restore pipelines."""

    def _batch_budget(self) -> int:
        """Encoded (workspace) bytes of one codec batch. With the GPU engine two batches share its workspace
        (one running while the host finishes the previous one), so each takes half of it."""
        budget = self._config.storage_codec_budget
        return max(budget // 2 - (1 << 20), 1 << 20) if self._gpu_codecs is not None else budget

    def _codec_batches(self, items: Iterable, nbytes: Callable, logical: "Callable | None" = None) -> Iterator[list]:
        """``items`` in the batches of a save or a restore: at most ``batch_segments``, and the codec budget
        in ``nbytes`` (one item may exceed it); with ``logical``, also at most ``BATCH_EXPANSION`` budgets of
        those bytes."""
        budget = self._batch_budget()
        batch: list = []
        size = total = 0
        for it in items:
            n = nbytes(it)
            m = logical(it) if logical is not None else 0
            if batch and (len(batch) >= self._config.batch_segments or size + n > budget
                          or total + m > BATCH_EXPANSION * budget):
                yield batch
                batch, size, total = [], 0, 0
            batch.append(it)
            size += n
            total += m
        if batch:
            yield batch

    def _run_batches(self, runs: Iterable[tuple[object, Sequence[int], Sequence[int]]]) -> Iterator[list]:
        """:meth:`_codec_batches` of items that come in runs (a save's chunks), as slices of the runs: each
        run is ``(run, nbytes, logical)``, the cumulative sums of its items' counted and logical bytes
        (``nbytes[j]``: the first ``j`` items; ``len(nbytes) - 1`` items); each batch a list of pieces
        ``(run, lo, hi)``, its items ``lo .. hi`` of that run. The same cuts, made with a few bisections per
        run instead of a test per item."""
        budget = self._batch_budget()
        cap, most = self._config.batch_segments, BATCH_EXPANSION * budget
        batch: list = []
        count = size = total = 0
        for run, cn, cm in runs:
            k = len(cn) - 1
            j = 0
            while j < k:
                lo = j
                if not count:  # the first item of a batch goes in whatever its size
                    size, total, count = cn[j + 1] - cn[j], cm[j + 1] - cm[j], 1
                    j += 1
                # the items j..j+t-1 that fit: the count, the budget and the logical cap, each a prefix
                t = min(cap - count, k - j,
                        bisect_right(cn, budget - size + cn[j], j, k + 1) - 1 - j,
                        bisect_right(cm, most - total + cm[j], j, k + 1) - 1 - j)
                if t > 0:
                    size += cn[j + t] - cn[j]
                    total += cm[j + t] - cm[j]
                    count += t
                    j += t
                if j > lo:
                    batch.append((run, lo, j))
                if j < k:
                    yield batch
                    batch, count, size, total = [], 0, 0, 0
        if batch:
            yield batch
