"""The SSD tier's prefetch lane (``SsdTier.prefetch``, what a Manager's readahead queues after a lookup or restore
that the SSD served) over records laid out two ways: ``adjacent``, every record of a shard end to end (what a
demotion of whole chunks leaves), and ``apart``, every other record. Record sizes of a 32 KiB and a 512 KiB
segment, in requests of 144 keys (two chunks of 36 layers, K and V: the default readahead of
``--ssd-prefetch-chunks 2``), queued at once; the sink only counts. REPS passes of each, alternating layouts;
medians of wall GB/s of record bytes until the last sink call, and of the process's CPU per record (the lane's
thread: the caller sleeps meanwhile). The shard is read from the page cache after the first pass.

Usage: PYTHONPATH=<tree> python prefetch_windows.py DIR [REPS] [MIB]"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import numpy as np

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import HEADER_SIZE, Format, Role, SegmentHeader, build_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import record_length

NS = b"prefetch-windows"
REQUEST = 144


def _segment(payload: int, i: int) -> bytes:
    body = np.random.default_rng(i).integers(0, 256, payload, dtype=np.uint8)
    return build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), payload, payload, 0), body)


def main() -> None:
    d = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    for seg_kib in (32, 512):
        payload = (seg_kib << 10) - HEADER_SIZE
        rec = record_length(payload + HEADER_SIZE)
        n = (mib << 20) // rec
        keys = [ObjectKey(NS, chunk_key(f"c{i // 72}"), i % 72 // 2, Role.KEY if i % 2 == 0 else Role.VALUE)
                for i in range(n)]
        segs = [_segment(payload, i) for i in range(16)]
        path = os.path.join(d, f"prefetch-windows-{os.getpid()}.okv")
        try:
            cfg = SsdConfig(paths=(path,), capacity=n * rec + (64 << 20), prefetch_max_bytes=n * rec + (1 << 20))
            with SsdTier(cfg) as t:
                for i, k in enumerate(keys):
                    assert t.submit(k, segs[i % 16], timeout=60.0)
                t.flush()
                sets = {"adjacent": keys, "apart": keys[::2]}
                walls: dict[str, list[float]] = {s: [] for s in sets}
                cpus: dict[str, list[float]] = {s: [] for s in sets}
                done = threading.Semaphore(0)

                def sink(key: ObjectKey, seg: bytes) -> None:
                    done.release()

                for _ in range(reps):
                    for name, ks in sets.items():
                        t0, c0 = time.perf_counter(), time.process_time()
                        queued = sum(t.prefetch(ks[i:i + REQUEST], sink) for i in range(0, len(ks), REQUEST))
                        assert queued == len(ks), (queued, len(ks))
                        for _ in ks:
                            assert done.acquire(timeout=60)
                        walls[name].append(time.perf_counter() - t0)
                        cpus[name].append(time.process_time() - c0)
                snap = t.snapshot()
                assert snap.prefetch_errors_total == 0 and snap.prefetch_dropped_total == 0, snap
                for name, ks in sets.items():
                    w, c = statistics.median(walls[name]), statistics.median(cpus[name])
                    print(f"{seg_kib} KiB segments, {name}: {len(ks)} records of {rec >> 10} KiB, "
                          f"{len(ks) * rec / w / 1e9:.2f} GB/s, {c / len(ks) * 1e6:.1f} us CPU a record", flush=True)
        finally:
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()
