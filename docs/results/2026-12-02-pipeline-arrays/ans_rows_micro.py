"""Host cost of an ANS decode batch's descriptor rows, 97b31c3's `_decode_rows` (plans) against this
stop's `_plan_cols` + `_decode_rows` (columns), 256 ANS segments of 512 KiB, one process, alternating.
Needs cupy importable (no GPU). Usage, from the repository root, with BASE_TREE laid out as ab.sh lays it
out (BASE_TREE/orbitkv_fs/gpu/engine.py): python ans_rows_micro.py BASE_TREE"""

from __future__ import annotations

import importlib.util
import random
import sys
import timeit
import types

import numpy as np

import orbitkv_fs.gpu.engine as new
from orbitkv_fs.codecs.fp8 import BF16
from orbitkv_fs.segment import AnsType, Format, Role, SegmentHeader


def main(base_tree: str) -> None:
    spec = importlib.util.spec_from_file_location("old_engine", f"{base_tree}/orbitkv_fs/gpu/engine.py")
    old = importlib.util.module_from_spec(spec)
    old.__package__ = "orbitkv_fs.gpu"
    sys.modules["old_engine"] = old
    spec.loader.exec_module(old)
    rng = random.Random(1)
    plans = []
    for i in range(256):
        h = SegmentHeader(Format.ANS, BF16, 1 << 19, 300000 + rng.randrange(50000), rng.getrandbits(32), role=Role.KEY,
                          layer=i % 36, ans_type=AnsType.FLOAT16)
        plans.append(types.SimpleNamespace(kind="ans", h=h, meta=i, staged=i * 400000,
                                           dst=types.SimpleNamespace(ptr=1 << 40), scratch=i << 20, chunk0=i * 8))
    buf = np.zeros(256 * 128 * 2 + 4096, np.uint8)
    base = 1 << 41
    src = np.array([base + p.staged for p in plans], np.int64)

    def run_new() -> None:
        new._decode_rows(buf, 0, new._plan_cols(plans, src, base), base + 1, base + 2)

    def run_old() -> None:
        stored = np.array([p.h.stored_length for p in plans])
        exp = (np.array([p.h.payload_crc for p in plans], np.uint32) ^ new.zero_crc(stored)).tolist()
        old._decode_rows(buf, 0, plans, [], [], plans, lambda p: base + p.staged, exp, base + 1, base + 2, base)

    for f in (run_old, run_new, run_old, run_new):
        us = min(timeit.repeat(f, number=20, repeat=5)) / 20 / 256 * 1e6
        print(f"{f.__name__}: {us:.2f} us per segment")


if __name__ == "__main__":
    main(sys.argv[1])
