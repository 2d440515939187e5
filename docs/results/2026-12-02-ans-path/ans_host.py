"""The GPU engine's host work for an `ans` save batch, without a GPU: ``encode_submit`` + ``encode_collect`` of
``--segments`` BF16 segments of ``--kib`` KiB through the engine's item path (``--path items``) or
``encode_columns_submit`` (``--path columns``, where the tree has ANS on it; one class per (layer, role)),
the worker's CUDA calls and nvCOMP replaced by no-ops (engine_host.py's NullWorker; a fake nvCOMP with a 64 KiB
temp), each batch's payload lengths set as nvCOMP would leave them (``--ratio`` of the source, plus up to 4 KiB
at random, so every batch has new lengths, as real ones do). Needs cupy importable, not a GPU.

Usage: python ans_host.py [--kib 512] [--segments 200] [--ratio 0.69] [--repeat 20] [--path items|columns]"""

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

from orbitkv_fs.gpu import engine as E  # noqa: E402
from orbitkv_fs.segment import Role  # noqa: E402


class FakeNvcomp:
    def max_compressed_bytes(self, n: int, t) -> int:
        return n + 1024

    def compress_temp_bytes(self, *a) -> int:
        return 1 << 16

    def compress(self, *a) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=512)
    ap.add_argument("--segments", type=int, default=200)
    ap.add_argument("--ratio", type=float, default=0.69)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--path", choices=("items", "columns"), default="items")
    a = ap.parse_args()
    E._pinned_array = lambda n: np.zeros(max(n, 1), np.uint8)
    E.cp.cuda.runtime.memcpyAsync = lambda *args: None
    if hasattr(E.km, "launch_ans_place"):
        E.km.launch_ans_place = lambda *args: 1
    eng = H.null_engine()
    eng._nvcomp = FakeNvcomp()
    eng._ans_packed = 1.0
    eng.save.stream = eng.save.copies = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    rng = np.random.default_rng(0)
    finish = E.GpuCodecEngine._finish_encode

    def with_lengths(self, plans, job, off, host, *rest):  # what nvCOMP and okv_ans_pack leave in pay_len
        ans = sorted((p for p in plans if p.kind == "ans"), key=lambda p: p.ans_type)
        at = off["pay_len"] - off["meta"]
        sizes = np.array([(int(p.n * a.ratio) + int(rng.integers(0, 4096)) + 7) // 8 * 8 for p in ans], dtype="<u8")
        host[at:at + 8 * len(ans)] = sizes.view(np.uint8)
        return finish(self, plans, job, off, host, *rest)

    E.GpuCodecEngine._finish_encode = with_lengths
    finish_cols = getattr(E.GpuCodecEngine, "_finish_encode_columns", None)

    def cols_with_lengths(self, cs, c, rows, ptrs, slots, job, host, views, off=None, a=None, region=0):
        if a is not None and len(a):
            at = off["pay_len"] - off["meta"]
            sizes = [(int(cs.table.n[c[j]] * a_.ratio) + int(rng.integers(0, 4096)) + 7) // 8 * 8 for j in a.tolist()]
            host[at:at + 8 * len(a)] = np.array(sizes, dtype="<u8").view(np.uint8)
        return finish_cols(self, cs, c, rows, ptrs, slots, job, host, views, off, a, region)

    a_ = a
    E.GpuCodecEngine._finish_encode_columns = cols_with_lengths
    n = a.kib << 10
    items = [E.EncodeItem(E.DeviceSpan((1 << 41) + i * (n + 4096), n, (n // 2048, 8, 128)), "ans",
                          Role.KEY if i % 2 else Role.VALUE, i // 2 % 36, H.BF16) for i in range(a.segments)]
    arena = np.zeros(2 * a.segments * (n + 4096) + (64 << 20), np.uint8)
    used = [0]

    def region(nbytes: int) -> np.ndarray:
        r = arena[used[0]:used[0] + nbytes]
        used[0] = (used[0] + nbytes + 4095) // 4096 * 4096
        return r

    if a.path == "columns":
        classes = [eng.encode_class(items[j]) for j in range(min(72, a.segments))]  # one per (layer, role)
        cls = np.arange(a.segments) % len(classes)
        ptrs = np.array([it.array.ptr for it in items], dtype=np.int64)
    ts = []
    for _ in range(a.repeat):
        used[0] = 0
        t = time.perf_counter()
        if a.path == "columns":
            job = eng.encode_columns_submit(classes, cls, ptrs, out_region=region, slot_align=512)
            assert job is not None
            eng.encode_collect(job)
        else:
            eng.encode_collect(eng.encode_submit(items, out_region=region, slot_align=512))
        ts.append(time.perf_counter() - t)
    m = statistics.median(ts)
    print(f"ans {a.kib} KiB x {a.segments} ({a.path}), {eng.save.stats['batches'] // a.repeat} engine batches a call: "
          f"best {min(ts) * 1e6:.0f} us, median {m * 1e6:.0f} us, {m * 1e6 / a.segments:.2f} us per segment")


if __name__ == "__main__":
    main()
