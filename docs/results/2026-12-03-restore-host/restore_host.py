"""Host work of a GPU restore, on a machine without a GPU: the Manager's restore on its rows path (lease, size
checks, the early first batch, header verification per batch, ``decode_columns_submit``, verdicts, block-copy
tables) with the GPU engine's streams, kernels and copies replaced by no-ops, over the bench's geometry (36
layers, 512 KiB segments, shuffled blocks, 2,304 segments a restore): the save harness of
../2026-12-03-save-host/save_host.py saves once, then each repeat restores every chunk. Nothing is decoded;
the null kernels' zero accumulators match the CRCs the null save wrote (its headers, where the GPU writes them,
by okv_write_headers' host model), so every segment passes as on a GPU.

Usage: python restore_host.py [--codec turboquant-4] [--repeat 40] [--stages] [--cold]
Prints the median wall and thread CPU per restore and per segment; ``--stages`` adds per-step wall clock
(../2026-12-02-pipeline-host-cuts/stage_timers.py). ``--cold``: before each restore (not timed) 512 MiB of
other memory is written, so that the arena's header lines are in no cache and no TLB, as after the bench's
1.2 GB save on the H200 (../2026-12-03-gpu-suite)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, *path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, *path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# the restore's steps that stage_timers.py does not time
RESTORE_STEPS = ["RestorePipeline._start_early", "RestorePipeline._rows_submit", "RestorePipeline._row_targets",
                 "RestorePipeline._lease_dram", "RestorePipeline._check_chunks", "_Rows.of", "segment_keys",
                 "RestorePipeline._cuts", "RestorePipeline._early_head"]
save_host = _load("save_host", "..", "2026-12-03-save-host", "save_host.py")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="turboquant-4")
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--segment-kib", type=int, default=512)
    p.add_argument("--stages", action="store_true", help="per-step wall clock of the restore's batch steps")
    p.add_argument("--cold", action="store_true", help="write 512 MiB of other memory before each restore")
    args = p.parse_args()
    import cupy  # the restore's last step synchronises the current stream: none here

    cupy.cuda.get_current_stream = lambda: save_host._NULL_EVENT
    with save_host.harness(args.codec, args.segment_kib, headers=True) as h:
        m, eid, nseg = h.m, h.e.engine_id, h.nseg
        r = m.save(eid, h.chunks)
        assert r.segments == nseg, r
        timers = None
        if args.stages:
            timers = _load("stage_timers", "..", "2026-12-02-pipeline-host-cuts", "stage_timers.py")
            timers.TARGETS["orbitkv_fs.manager.restore"] += RESTORE_STEPS
            timers.TARGETS["orbitkv_fs.manager.verify"] += ["_distinct_fixed", "_templates_of"]
            timers.install()
        walls, cpus = [], []
        scrub = np.zeros(512 << 20, np.uint8) if args.cold else None
        for rep in range(args.repeat):
            if scrub is not None:
                scrub.fill(rep & 0xFF)
            if timers is not None and rep == 2:  # the steady state: numba loaded, the first plans made
                for rec in timers.stats.values():
                    rec[0], rec[1] = 0, 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            got = m.restore(eid, h.chunks)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            assert got.segments == nseg and all(got.restored), got.misses[:3]
        w, c = np.median(walls[2:]) * 1e6, np.median(cpus[2:]) * 1e6
        st = m._gpu_codecs.engine(h.eng.reg.rotation_seed).restore.stats
        print(f"{args.codec} {args.segment_kib} KiB restore: {nseg} segments, {st['batches'] // args.repeat} engine "
              f"flights a restore; median wall {w:.0f} us ({w / nseg:.2f} us/seg), thread CPU {c:.0f} us "
              f"({c / nseg:.2f} us/seg)")
        n = args.repeat - 2
        for name, (calls, s) in sorted((timers.stats if timers else {}).items(), key=lambda kv: -kv[1][1]):
            if calls:
                print(f"{name:40s} {s / n * 1e6:8.0f} us/restore  {calls / n:5.1f} calls/restore")


if __name__ == "__main__":
    main()
