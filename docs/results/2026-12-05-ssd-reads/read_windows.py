"""The SSD tier's demand read (``SsdTier.read_many`` into a sink that drops each segment, as DRAM admission
takes it) of records laid out two ways: ``adjacent``, every record of a shard end to end (what a demotion of
whole chunks leaves), and ``apart``, every other record (the ones between are not read: each read record
stands alone on disk). Record sizes of a 32 KiB and a 512 KiB segment; REPS reads of each, alternating
layouts; medians of wall GB/s of record bytes and of this thread's CPU per record.

Usage: PYTHONPATH=<tree> python read_windows.py DIR [REPS] [MIB]"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import HEADER_SIZE, Format, Role, SegmentHeader, build_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import record_length

NS = b"read-windows-ns!"


def _segment(payload: int, i: int) -> bytes:
    body = np.random.default_rng(i).integers(0, 256, payload, dtype=np.uint8)
    return build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), payload, payload, 0), body)


def main() -> None:
    d = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    for seg_kib in (32, 512):
        payload = (seg_kib << 10) - HEADER_SIZE
        rec = record_length(payload + HEADER_SIZE)
        n = (mib << 20) // rec
        keys = [ObjectKey(NS, chunk_key(f"c{i // 72}"), i % 72 // 2, Role.KEY if i % 2 == 0 else Role.VALUE)
                for i in range(n)]
        segs = [_segment(payload, i) for i in range(16)]
        path = os.path.join(d, f"read-windows-{os.getpid()}.okv")
        try:
            with SsdTier(SsdConfig(paths=(path,), capacity=n * rec + (64 << 20))) as t:
                for i, k in enumerate(keys):
                    assert t.submit(k, segs[i % 16], timeout=60.0)
                t.flush()
                sets = {"adjacent": keys, "apart": keys[::2]}
                walls: dict[str, list[float]] = {s: [] for s in sets}
                cpus: dict[str, list[float]] = {s: [] for s in sets}
                got = [0]

                def sink(i: int, seg: memoryview) -> None:
                    got[0] += 1

                for _ in range(reps):
                    for name, ks in sets.items():
                        got[0] = 0
                        t0, c0 = time.perf_counter(), time.thread_time()
                        t.read_many(ks, sink=sink)
                        walls[name].append(time.perf_counter() - t0)
                        cpus[name].append(time.thread_time() - c0)
                        assert got[0] == len(ks), (got[0], len(ks))
                for name, ks in sets.items():
                    w, c = statistics.median(walls[name]), statistics.median(cpus[name])
                    print(f"{seg_kib} KiB segments, {name}: {len(ks)} records of {rec >> 10} KiB, "
                          f"{len(ks) * rec / w / 1e9:.2f} GB/s, {c / len(ks) * 1e6:.1f} us CPU a record")
        finally:
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()
