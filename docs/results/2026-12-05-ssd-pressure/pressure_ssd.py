"""A save into a full DRAM pool whose evictions go to an SSD tier: the steady state of a serving engine whose
prefixes outgrow DRAM, on the Manager's CPU host path (`none`, 32 KiB segments, 512 blocks x 8 layers: 8,192
segments a save, the pipeline bench's engine pages).

Modes (``MODE[:s3fifo]``):

* ``fresh``: the pool invalidated before each save (nothing evicted; as ``orbitkv-bench pipeline``);
* ``pressure``: a pool of about one save's bytes, new keys every save, no lower tier: each save evicts as
  many segments as it admits, and drops them;
* ``ssd``: the same with an SSD tier (a file of 8 GiB under ``SSD_DIR``, default /tmp): every victim is
  demoted (copied into the SSD lane's staging and queued for writeback) inside the save.

Between saves the process sleeps ``SLEEP`` seconds (default 0.3), so that the lane drains as it would between
an engine's requests. Per mode, the median of saves 3-10: wall ms, this thread's CPU (user + system) and system
CPU per segment, minor page faults per segment, and how many victims the SSD tier took.

Usage: PYTHONPATH=<tree> python pressure_ssd.py [--json OUT] MODE..."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tools.bench_pipeline import BLOCK_BYTES, _engine

BLOCKS, LAYERS, SAVES = 512, 8, 10


def run(mode: str, policy: str, pages, reg, sleep: float, ssd_dir: str) -> dict:
    nseg = BLOCKS * LAYERS * 2
    pool = nseg * (BLOCK_BYTES + 512) * (3 if mode == "fresh" else 1) + (16 << 20)
    path = os.path.join(ssd_dir, f"pressure-ssd-{os.getpid()}.bin")
    lower = SsdTier(SsdConfig(paths=(path,), capacity=8 << 30)) if mode == "ssd" else None
    try:
        with Manager(ManagerConfig(pool_size=pool, device="cpu", eviction=policy), lower_tier=lower) as m:
            e = m.register_engine(reg)
            wall, cpu, sys_, faults = [], [], [], []
            for rep in range(SAVES):
                chunks = [ChunkBlocks(chunk_key(f"{mode}-{rep}-{i}"), [i]) for i in range(BLOCKS)]
                if mode == "fresh":
                    m.invalidate(all=True)
                r0 = resource.getrusage(resource.RUSAGE_THREAD)
                t0 = time.perf_counter()
                r = m.save(e.engine_id, chunks)
                wall.append(time.perf_counter() - t0)
                r1 = resource.getrusage(resource.RUSAGE_THREAD)
                assert r.segments == nseg, (r.segments, r.dropped_segments)
                cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                sys_.append(r1.ru_stime - r0.ru_stime)
                faults.append(r1.ru_minflt - r0.ru_minflt)
                time.sleep(sleep)
            st = m.stats()
            med = lambda xs: statistics.median(xs[2:])  # noqa: E731
            return {"mode": mode, "policy": policy, "segments": nseg, "wall_ms": med(wall) * 1e3,
                    "cpu_us_per_segment": med(cpu) / nseg * 1e6, "sys_us_per_segment": med(sys_) / nseg * 1e6,
                    "faults_per_segment": med(faults) / nseg, "gb_per_s": nseg * BLOCK_BYTES / med(wall) / 1e9,
                    "evictions": st.evictions, "demoted": st.demoted}
    finally:
        if lower is not None and os.path.exists(path):
            os.unlink(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="+")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sleep = float(os.environ.get("SLEEP", "0.3"))
    ssd_dir = os.environ.get("SSD_DIR", "/tmp")
    pages, reg = _engine(BLOCKS, LAYERS)
    out = []
    try:
        for arg in args.modes:
            mode, _, policy = arg.partition(":")
            r = run(mode, policy or "lru", pages, reg, sleep, ssd_dir)
            out.append(r)
            print(f"{arg:>12}: save {r['wall_ms']:.1f} ms ({r['gb_per_s']:.2f} GB/s), "
                  f"{r['cpu_us_per_segment']:.2f} us CPU per segment ({r['sys_us_per_segment']:.2f} system), "
                  f"{r['faults_per_segment']:.2f} faults per segment, demoted {r['demoted']} of {r['evictions']}",
                  flush=True)
    finally:
        pages.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
