"""How the pipelines cut work into codec batches and overlap them.

Primitives: :meth:`Batching._codec_batches` (at most ``batch_segments`` segments, the batch budget in
workspace bytes, the source cap in source bytes; a run that one batch holds whole is not split for a sliver of
it), :meth:`Batching._run_batches` (the same cut of items that come in runs with their cumulative sizes, a
save's chunks: each batch as slices of the runs), :class:`RunCutter` (that cut fed a run at a time, as the
host path of exact segments cuts its batches while a save's chunks go by),
:meth:`Batching._flight_budget` (with the GPU engine, half its workspace: one flight, two of which share it),
:meth:`Batching._flights` (flights per batch of a registration), :meth:`Batching._batch_budget` (that many
flights), :meth:`Batching._source_cap` (``BATCH_EXPANSION`` flights of source bytes), :func:`_pipelined`
(batch i+1 started before batch i ends), :func:`_coded_bound` / :func:`_decode_bound` (the workspace a segment
takes).

Invariants: a batch never passes the budget unless one segment alone does; :func:`_pipelined` ends every
item it started, also when one fails.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import groupby
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from ..segment import TURBOQUANT_HEAD_DIMS, Format, Role, SegmentHeader, turboquant_stored_bytes

if TYPE_CHECKING:
    from .registry import _Engine, _Seg


#: A codec batch's source (save) or decoded (restore) bytes are at most this many flight budgets: the
#: gathered sources and decoded temporaries live outside the workspace, and stay bounded.
BATCH_EXPANSION = 4

#: Engine flights per codec batch with the GPU engine, for registrations whose segments take their full size in
#: the workspace (`none`, `ans`; restores of `none` only: :meth:`Batching._flights`). The engine runs a batch
#: as flights of at most half its workspace (two in flight side by side); the Manager's own per-batch host
#: work (the block-copy table, the publish, the index's batch step: mostly fixed, the index's alone 74 us for
#: 254 segments and 89 us for 512 on a 2-core EPYC) is paid once per batch, so a batch of two flights pays it
#: once for both: the workspace closed those codecs' batches at one flight. The compressing codecs' batches
#: reach ``batch_segments`` first at vLLM's 512 KiB chunks (`fp8`: 512 segments are one flight and a hair),
#: where two flights only split them (`fp8` saved 2-4% slower). `ans` restores of two flights' decoded bytes
#: ran 5-14% slower while nvCOMP decompressed into workspace scratch (docs/results/2026-12-03-host-work); on the
#: rows path it now decompresses into the restore's temporary, an `ans` segment takes its payload alone, and
#: its restores take two flights too (docs/results/2026-12-04-ans-restore). The gathered sources stay within
#: the source cap as before (BATCH_EXPANSION flights).
BATCH_FLIGHTS = 2

#: A save batch that would end inside a chunk (a run of :meth:`Batching._run_batches`) that one batch can hold
#: whole, with at most 1 / ALIGN_SHARE of its segments from that chunk, ends before the chunk instead: the
#: next batch takes it whole. Each chunk a batch splits costs the index two more placements (the head as a
#: chunk of its own, the rest added to it) and both batches a run of a chunk apart; at vLLM's 512 KiB a
#: 72-segment chunk made every 512-segment batch split one, and 504-segment batches of whole chunks cut the
#: host work of a GPU save by 4-5% (docs/results/2026-12-03-save-host).
ALIGN_SHARE = 4

#: A restore's first batches that start part by part, before the rest of the request is leased and checked (each
#: part's chunks leased and checked, then its batch started): the pipeline's depth (:func:`_pipelined`). The GPU
#: copies the first while the host readies the second, and the second while the host leases and checks the rest.
#: With one, the GPU idled 0.5-0.9 ms of a `turboquant-4` 512 KiB restore's 10.9 ms after it (H200); two made
#: those restores 1.03x as fast, the other codecs and sizes 1.00-1.01x (docs/results/2026-12-06-head-targets).
EARLY_BATCHES = 2


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
    """The bytes a restore batch of items (not the rows path, whose batches count payloads alone) counts for
    a segment with header ``h``: its payload (the workspace it is staged in); for ANS its decoded size, as
    before: the engine's workspace also holds nvCOMP's output there, and
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

    def _flight_budget(self) -> int:
        """Encoded (workspace) bytes of one engine flight. With the GPU engine two flights share its workspace
        (one running while the host finishes the previous one), so each takes half of it (less a MiB for the
        flight's descriptors and metadata); on the host path the budget."""
        budget = self._config.storage_codec_budget
        return max(budget // 2 - (1 << 20), 1 << 20) if self._gpu_codecs is not None else budget

    def _flights(self, eng: "_Engine", *, restore: bool = False, rows: bool = False) -> int:
        """Engine flights per codec batch of ``eng`` 's segments: ``BATCH_FLIGHTS`` with the GPU engine where
        every segment takes its full size in the workspace (saves of `none` and `ans` registrations, restores
        of `none` ones, and of `ans` ones on the rows path, where nvCOMP decompresses in place and an `ans`
        segment takes its payload alone), else one."""
        wide = {"none"} if restore and not rows else {"none", "ans"}
        return BATCH_FLIGHTS if self._gpu_codecs is not None and eng.codecs <= wide else 1

    def _batch_budget(self, flights: int = 1) -> int:
        """Encoded (workspace) bytes of one codec batch of ``flights`` flights (the GPU engine cuts a batch
        into flights of equal bytes)."""
        return flights * self._flight_budget()

    def _source_cap(self) -> int:
        """Source (save) or decoded (restore) bytes of one codec batch, at most: ``BATCH_EXPANSION`` flight
        budgets."""
        return BATCH_EXPANSION * self._flight_budget()

    def _codec_batches(self, items: Iterable, nbytes: Callable, logical: "Callable | None" = None,
                       flights: int = 1, run: "Callable | None" = None) -> Iterator[list]:
        """``items`` in the batches of a save or a restore: at most ``batch_segments``, and the budget of
        ``flights`` flights in ``nbytes`` (one item may exceed it); with ``logical``, also at most the source
        cap in those bytes. With ``run`` (an item's run, a save's chunk; consecutive items of one run), a run
        that one batch can hold whole, of which the batch under way would take part, at most a quarter of its
        items, before closing, goes whole to the next batch instead (:data:`ALIGN_SHARE`)."""
        budget, most = self._batch_budget(flights), self._source_cap()
        cap = self._config.batch_segments
        logical = logical or (lambda it: 0)
        batch: list = []
        size = total = 0
        for group in ([items] if run is None else (list(g) for _, g in groupby(items, run))):
            if run is not None and batch:
                ns, ms = [nbytes(it) for it in group], [logical(it) for it in group]
                if len(group) <= cap and sum(ns) <= budget and sum(ms) <= most:
                    t, s, m = 0, size, total  # the run's items the batch takes before it closes
                    while (t < len(group) and len(batch) + t < cap and s + ns[t] <= budget
                           and m + ms[t] <= most):
                        s, m, t = s + ns[t], m + ms[t], t + 1
                    if t < len(group) and ALIGN_SHARE * t <= len(batch) + t:
                        yield batch
                        batch, size, total = [], 0, 0
            for it in group:
                n, m = nbytes(it), logical(it)
                if batch and (len(batch) >= cap or size + n > budget or total + m > most):
                    yield batch
                    batch, size, total = [], 0, 0
                batch.append(it)
                size += n
                total += m
        if batch:
            yield batch

    def _run_batches(self, runs: Iterable[tuple[object, Sequence[int], Sequence[int]]],
                     flights: int = 1) -> Iterator[list]:
        """:meth:`_codec_batches` (of ``flights`` flights, ``run``: the runs) of items that come in runs (a
        save's chunks), as slices of the runs: each run is ``(run, nbytes, logical)``, the cumulative sums of its
        items' counted and logical bytes (``nbytes[j]``: the first ``j`` items; ``len(nbytes) - 1`` items); each
        batch a list of pieces ``(run, lo, hi)``, its items ``lo .. hi`` of that run. The same cuts, made with a
        few bisections per run instead of a test per item (:class:`RunCutter`)."""
        cut = RunCutter(self._config.batch_segments, self._batch_budget(flights), self._source_cap())
        for run, cn, cm in runs:
            yield from cut.push(run, cn, cm)
        if cut.batch:
            yield cut.batch


class RunCutter:
    """The cut of :meth:`Batching._run_batches`, fed a run at a time (:meth:`push` answers the batches that run
    closes; ``batch`` holds the one under way): at most ``cap`` items, ``budget`` counted bytes and ``most``
    logical bytes a batch, the first item of a batch in whatever its size, and a run that one batch holds whole,
    begun short (at most 1 / ALIGN_SHARE of the batch), moved whole to the next batch."""

    __slots__ = ("cap", "budget", "most", "batch", "count", "size", "total")

    def __init__(self, cap: int, budget: int, most: int) -> None:
        self.cap, self.budget, self.most = cap, budget, most
        self.batch: list = []
        self.count = self.size = self.total = 0

    def push(self, run: object, cn: Sequence[int], cm: Sequence[int]) -> list[list]:
        """Add ``run`` (``cn``, ``cm``: cumulative counted and logical bytes of its items); answers the batches
        it closes (usually none: a run that fits whole goes in with one test)."""
        cap, budget, most = self.cap, self.budget, self.most
        k = len(cn) - 1
        if 0 < k <= cap - self.count and self.size + cn[k] - cn[0] <= budget and self.total + cm[k] - cm[0] <= most:
            self.batch.append((run, 0, k))
            self.count += k
            self.size += cn[k] - cn[0]
            self.total += cm[k] - cm[0]
            return []
        closed = []
        j = 0
        while j < k:
            lo = j
            if not self.count:  # the first item of a batch goes in whatever its size
                self.size, self.total, self.count = cn[j + 1] - cn[j], cm[j + 1] - cm[j], 1
                j += 1
            # the items j..j+t-1 that fit: the count, the budget and the logical cap, each a prefix
            t = min(cap - self.count, k - j,
                    bisect_right(cn, budget - self.size + cn[j], j, k + 1) - 1 - j,
                    bisect_right(cm, most - self.total + cm[j], j, k + 1) - 1 - j)
            if t > 0:
                self.size += cn[j + t] - cn[j]
                self.total += cm[j + t] - cm[j]
                self.count += t
                j += t
            if (j < k and not lo and self.batch and ALIGN_SHARE * j <= self.count and k <= cap and cn[k] <= budget
                    and cm[k] <= most):  # a run one batch holds whole, begun short: whole to the next one
                closed.append(self._close())
                j = 0
                continue
            if j > lo:
                self.batch.append((run, lo, j))
            if j < k:
                closed.append(self._close())
        return closed

    def _close(self) -> list:
        batch = self.batch
        self.batch, self.count, self.size, self.total = [], 0, 0, 0
        return batch
