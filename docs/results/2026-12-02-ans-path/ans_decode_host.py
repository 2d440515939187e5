"""The GPU engine's host work for an `ans` restore batch, without a GPU: ``decode_submit`` (the item path) against
``decode_columns_submit`` (the array path, chunk tables parsed from the array the payloads lie in) of
``--segments`` ANS segments of ``--kib`` KiB laid out in one host array as a save leaves them in the arena
(random chunk bytes behind valid tables), the worker's CUDA calls and nvCOMP replaced by no-ops. Times the
submit only (both finish the same way). Needs cupy importable, not a GPU.

Usage: python ans_decode_host.py [--kib 512] [--segments 200] [--repeat 20]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-02-gpu-host"))
import engine_host as H  # noqa: E402

from orbitkv_fs.gpu import ans_format as A  # noqa: E402
from orbitkv_fs.gpu import engine as E  # noqa: E402
from orbitkv_fs.segment import HEADER_SIZE, AnsType, Format, Role, SegmentHeader, pack_header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=512)
    ap.add_argument("--segments", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    E._pinned_array = lambda n: np.zeros(max(n, 1), np.uint8)
    eng = H.null_engine()
    eng._nvcomp = types.SimpleNamespace(decompress_temp_bytes=lambda *args: 1 << 16, decompress=lambda *args: None)
    eng.restore.stream = eng.restore.copies = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    n, k = a.kib << 10, a.segments
    rng = np.random.default_rng(0)
    arena = np.zeros(k * (n + 4096), np.uint8)
    segs, offs, pos = [], [], 0
    for i in range(k):
        payload = A.pack([bytes(int(x)) for x in rng.integers(40000, 50000, A.chunk_count(n))])
        h = SegmentHeader(Format.ANS, np.dtype(H.BF16), n, len(payload), 0, role=Role.KEY, layer=i % 36,
                          ans_type=AnsType.FLOAT16)
        blob = pack_header(h) + payload
        arena[pos:pos + len(blob)] = np.frombuffer(blob, np.uint8)
        segs.append(memoryview(arena)[pos:pos + len(blob)])
        offs.append(pos)
        pos = -(-(pos + len(blob)) // 512) * 512
    dsts = [E.DeviceSpan((1 << 42) + i * n, n, (n,)) for i in range(k)]
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs])
    src = arena.ctypes.data + np.array(offs, dtype=np.int64) + HEADER_SIZE
    dst = np.array([d.ptr for d in dsts], dtype=np.int64)
    runs = {"decode_submit (items)": lambda: eng.decode_submit(segs, dsts, pinned=[True] * k),
            "decode_columns_submit": lambda: eng.decode_columns_submit(heads, src, dst, np.full(k, n), within=arena)}
    for name, run in runs.items():
        ts = []
        for _ in range(a.repeat):
            t = time.perf_counter()
            assert run() is not None
            ts.append(time.perf_counter() - t)
            eng.restore.inflight.clear()
        m = statistics.median(ts)
        print(f"ans {a.kib} KiB x {k}, {name}: best {min(ts) * 1e6:.0f} us, median {m * 1e6:.0f} us, "
              f"{m * 1e6 / k:.2f} us per segment")


if __name__ == "__main__":
    main()
