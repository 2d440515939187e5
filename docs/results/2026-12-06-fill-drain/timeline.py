"""(From ../2026-12-03-early-batch, with the restore's prefix steps wrapped and the fill and drain printed.)

The GPU's and the host's timeline of the pipeline bench's saves and restores: which engine is busy when.

Runs ``orbitkv-bench pipeline --device gpu`` (the arguments after ``--``) with the GPU engine's workers and the
Manager's batch steps wrapped: a timing CUDA event before and after every bulk copy (``h2d_raw``/``d2h`` on the
copy stream), kernel launch and block-copy launch, and the host's clock around each batch step (the Manager's
submit / finish, the engine's waits). Events are read once the run ends, against one reference event whose host
time is known, so that GPU and host intervals share a clock (to within a sync's latency, some microseconds).

Usage: python timeline.py OUT [--keep N] -- <orbitkv-bench pipeline arguments>
Writes OUT/timeline.json (every interval of the last N saves and restores per codec and size) and prints, per
codec, size and direction: the wall time of a call, the copy engine's busy share of it, the bound (the copied
bytes at the run's baseline rate), its gaps (count, total, and what the host was doing when each began)."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time

import cupy as cp

from orbitkv_fs.gpu import engine as E
from orbitkv_fs.manager import restore as R
from orbitkv_fs.manager import save as S
from orbitkv_fs.manager import device as D
from orbitkv_fs.tools import bench_pipeline as B

gpu: list = []   # (lane, label, start event, end event, nbytes)
host: list = []  # (label, t0, t1) perf_counter seconds
calls: list = []  # (kind, codec, seg, t0, t1, first gpu index, first host index)
ref: dict = {}


def _ev(stream) -> "cp.cuda.Event":
    e = cp.cuda.Event()
    e.record(stream)
    return e


def _reference() -> None:
    if not ref:
        e = cp.cuda.Event()
        e.record(cp.cuda.Stream.null)
        e.synchronize()
        ref["event"], ref["t"] = e, time.perf_counter()


def _gpu_wrap(cls, name: str, lane_of, label_of, nbytes_of=lambda *a: 0) -> None:
    f = getattr(cls, name)

    @functools.wraps(f)
    def w(self, *a, **k):
        _reference()
        stream = lane_of(self, *a, **k)
        e0 = _ev(stream)
        out = f(self, *a, **k)
        lane = {id(self.copies): "copies", id(getattr(self, "scatters", None)): "scatters"}.get(id(stream), "stream")
        gpu.append((f"{self.name}:{lane}", label_of(*a, **k), e0,
                    _ev(stream), nbytes_of(*a, **k)))
        return out
    setattr(cls, name, w)


def _host_wrap(cls, name: str, label: str) -> None:
    f = getattr(cls, name)

    @functools.wraps(f)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            host.append((label, t0, time.perf_counter()))
    setattr(cls, name, w)


def install() -> None:
    W = E.Worker
    _gpu_wrap(W, "h2d_raw", lambda self, dst, src, n, stream=None: stream or self.stream,
              lambda dst, src, n, stream=None: "h2d", lambda dst, src, n, stream=None: n)
    _gpu_wrap(W, "d2h", lambda self, dst, src, stream=None: stream or self.stream,
              lambda dst, src, stream=None: "d2h", lambda dst, src, stream=None: dst.nbytes)
    _gpu_wrap(W, "launch", lambda self, *a, **k: self.stream, lambda k, name, *a, **kw: name)
    _gpu_wrap(W, "copy_blocks", lambda self, k, table, stream=None: stream or self.stream,
              lambda k, table, stream=None: f"blocks[{len(table)}]")
    # the engine's waits: the wait itself (event synchronize) and the batch's host part after it
    f = W.finish

    def finish(self, fl):
        if fl not in self.inflight:
            return
        t0 = time.perf_counter()
        fl.event.synchronize()
        t1 = time.perf_counter()
        f(self, fl)
        host.append((f"{self.name}:wait", t0, t1))
        host.append((f"{self.name}:finish", t1, time.perf_counter()))
    W.finish = finish
    for cls, name in ((S.SavePipeline, "_save_submit"), (S.SavePipeline, "_save_finish"),
                      (R.RestorePipeline, "_verified_rows"), (D._GpuCodecs, "decode_rows_submit"),
                      (D._GpuCodecs, "decode_rows_finish"), (D._GpuCodecs, "gather_rows"),
                      (E.GpuCodecEngine, "encode_columns_submit"), (E.GpuCodecEngine, "encode_collect"),
                      (E.Worker, "place"), (R.RestorePipeline, "_acquire"),
                      (R.RestorePipeline, "_check_device_batch"), (R.RestorePipeline, "_start_early"),
                      (R.RestorePipeline, "_rows_end"), (S.SavePipeline, "_save_items")):
        _host_wrap(cls, name, name)
    for cls, name in ((S.SavePipeline, "save"), (R.RestorePipeline, "restore")):
        _call_wrap(cls, name)


def _call_wrap(cls, name: str) -> None:
    f = getattr(cls, name)

    @functools.wraps(f)
    def w(self, *a, **k):
        g0, h0 = len(gpu), len(host)
        t0 = time.perf_counter()
        out = f(self, *a, **k)
        cp.cuda.Device().synchronize()
        calls.append((name, self._config.storage_codec, a[1][0].blocks.__len__() if a[1] else 0, t0,
                      time.perf_counter(), g0, h0, len(gpu), len(host)))
        return out
    setattr(cls, name, w)


def _at(e) -> float:
    return ref["t"] + cp.cuda.get_elapsed_time(ref["event"], e) / 1e3


def analyse(keep: int) -> dict:
    by: dict = collections.defaultdict(list)
    for c in calls:
        by[(c[0], c[1], c[2])].append(c)
    out = {}
    for key, cs in by.items():
        rows = []
        for name, codec, blocks, t0, t1, g0, h0, g1, h1 in cs[-keep:]:
            iv = [(lane, label, _at(a) - t0, _at(b) - t0, n) for lane, label, a, b, n in gpu[g0:g1]]
            hv = [(label, a - t0, b - t0) for label, a, b in host[h0:h1]]
            wall = t1 - t0
            bulk = sorted((a, b, n) for lane, label, a, b, n in iv if lane.endswith("copies") and n > (1 << 20))
            busy, gaps, end = 0.0, [], None
            for a, b, n in bulk:
                if end is not None and a > end + 2e-6:
                    doing = [lab for lab, x, y in hv if x <= end <= y]
                    gaps.append((end, a - end, doing))
                busy += b - a
                end = b if end is None else max(end, b)
            late = sorted((a, b, lane, label) for lane, label, a, b, n in iv if end is not None and b > end)
            rows.append({"wall_s": wall, "tail": [(a, b, f"{lane}/{label}") for a, b, lane, label in late],
                         "bulk_bytes": sum(n for *_, n in bulk), "bulk_busy_s": busy,
                         "first_copy_s": bulk[0][0] if bulk else None, "last_copy_end_s": end,
                         "gaps": gaps, "gpu": iv, "host": hv})
        out[f"{key[0]} {key[1]} {key[2] * 32} KiB"] = rows
    return out


def report(res: dict) -> str:
    lines = []
    for key, rows in res.items():
        lines.append(f"== {key}")
        for r in rows:
            gaps = r["gaps"]
            gap_s = sum(g[1] for g in gaps)
            lines.append(f"  wall {r['wall_s'] * 1e3:7.2f} ms  bulk {r['bulk_bytes'] / 2**20:8.1f} MiB in "
                         f"{r['bulk_busy_s'] * 1e3:7.2f} ms busy "
                         f"({r['bulk_bytes'] / max(r['bulk_busy_s'], 1e-9) / 1e9:5.1f}"
                         f" GB/s while busy)  first copy at {1e3 * (r['first_copy_s'] or 0):.2f} ms, last ends "
                         f"{1e3 * (r['last_copy_end_s'] or 0):.2f} ms; {len(gaps)} gaps {gap_s * 1e3:.2f} ms")
            before = collections.Counter()
            for label, a, b in r["host"]:
                if r["first_copy_s"] is not None and a < r["first_copy_s"]:
                    before[label] += min(b, r["first_copy_s"]) - a
            lines.append("      before the first copy, host (ms): " +
                         ", ".join(f"{lab} {v * 1e3:.2f}" for lab, v in before.most_common(8)))
            lines.append("      GPU work ending after the last copy (ms from start): " +
                         ", ".join(f"{lab} {a * 1e3:.2f}-{b * 1e3:.2f}" for a, b, lab in r["tail"][:8]))
            after = collections.Counter()
            for label, a, b in r["host"]:
                if r["last_copy_end_s"] is not None and b > r["last_copy_end_s"]:
                    after[label] += b - max(a, r["last_copy_end_s"])
            lines.append("      after the last copy, host (ms): " +
                         ", ".join(f"{lab} {v * 1e3:.2f}" for lab, v in after.most_common(8)))
            doing = collections.Counter()
            for _, d, what in gaps:
                doing[",".join(sorted(set(what))) or "-"] += d
            for what, d in doing.most_common(6):
                lines.append(f"      gap {d * 1e3:6.2f} ms while host in {what}")
        # kernels: per label total time of the last call
        r = rows[-1]
        k = collections.Counter()
        for lane, label, a, b, n in r["gpu"]:
            k[(lane, label)] += b - a
        lines.append("  last call, GPU lanes (summed event intervals, ms): " +
                     ", ".join(f"{l}/{lab} {v * 1e3:.2f}" for (l, lab), v in k.most_common(8)))
        h = collections.Counter()
        for label, a, b in r["host"]:
            h[label] += b - a
        lines.append("  last call, host steps (ms): "
                     + ", ".join(f"{lab} {v * 1e3:.2f}" for lab, v in h.most_common(10)))
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--keep", type=int, default=2)
    args = p.parse_args(argv[:cut])
    install()
    B.main(argv[cut + 1:] + ["--out", args.out])
    res = analyse(args.keep)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(res, f)
    text = report(res)
    with open(os.path.join(args.out, "timeline.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
