"""Python's cyclic garbage collector under an SSD tier at scale: the tier keeps several Python objects per
record (its slot, the key, set and dict entries), and CPython's collector traverses every tracked object of
the process in a full (generation 2) collection, holding the GIL: every engine's lookup, save and restore in
the Manager waits meanwhile.

A tier of one shard holding RECORDS records of 4 KiB (small segments, so the disk volume stays small; what
counts is the number of records) is filled through ``submit_many`` in batches of 72 (a chunk's segments, as
DRAM's eviction hands them over), then written over for another RECORDS records (the ring full: every write
evicts the oldest record, as in a cache's steady state). ``gc.callbacks`` times every collection. Meanwhile a
probe thread sleeps 1 ms at a time and records how late it wakes (a stand-in for an engine's call waiting for
the GIL).

Modes: ``default`` (the interpreter's settings); ``freeze`` (``gc.freeze()`` once the tier is open, as the
Manager's process does once its tiers are open).

Usage: PYTHONPATH=<tree> python gc_pauses.py DIR RECORDS MODE"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time

import numpy as np

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import record_length


def main() -> None:
    d, records, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    payload = 4096 - 128 - 64
    seg = build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), payload, payload, 0),
                        np.random.default_rng(0).integers(0, 256, payload, dtype=np.uint8))
    rec = record_length(len(seg))
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(timer)
    late: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)

    path = os.path.join(d, f"gc-pauses-{os.getpid()}.okv")
    th = threading.Thread(target=probe, daemon=True)
    try:
        with SsdTier(SsdConfig(paths=(path,), capacity=records * rec + (16 << 20), max_pending_bytes=64 << 20,
                               write_queue_depth=64)) as t:
            if mode == "freeze":
                # As the Manager's process does once its tiers are open (recovered): what lives from start-up
                # on (modules, the tiers' tables) is never traversed again.
                gc.collect()
                gc.freeze()
            th.start()
            t0 = time.perf_counter()
            for phase, lo in (("fill", 0), ("overwrite", records)):
                p0, n0, l0 = time.perf_counter(), len(pauses), len(late)
                for b in range(lo, lo + records, 72):
                    keys = [ObjectKey(b"gc-pauses-bench!", chunk_key(b), j // 2, Role.KEY if j % 2 else Role.VALUE)
                            for j in range(min(72, lo + records - b))]
                    while t.submit_many(keys, [seg] * len(keys)) < len(keys):
                        time.sleep(0.002)  # the lane is full: let it drain (what was taken is taken again
                        # as already stored; what was dropped is submitted again)
                t.flush()
                ps = pauses[n0:]
                full = [s for g, s in ps if g == 2]
                lt = sorted(late[l0:])
                print(f"{mode} {phase}: {records} records in {time.perf_counter() - p0:.1f} s; "
                      f"{len(ps)} collections, {sum(s for _, s in ps):.2f} s in all; "
                      f"full: {len(full)}, longest {max(full, default=0) * 1e3:.0f} ms, "
                      f"median {statistics.median(full) * 1e3 if full else 0:.0f} ms; "
                      f"probe late p99 {lt[int(len(lt) * 0.99)] * 1e3:.1f} ms, max {lt[-1] * 1e3:.0f} ms; "
                      f"tracked objects {len(gc.get_objects())}", flush=True)
            print(f"{mode}: objects {t.snapshot().objects}, total {time.perf_counter() - t0:.1f} s")
    finally:
        stop.set()
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
