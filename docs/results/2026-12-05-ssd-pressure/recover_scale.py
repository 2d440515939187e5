"""`--ssd-recover` of one shard file full of 32 KiB segments' records, timed, with the chain walk (the part
after the scan: which records the log vouches for) timed apart. The first call with a path writes the shard
(the tier's own submit, then a clean close); later calls, with any tree, only recover it (a recovery that
writes nothing leaves the records as they were).

Usage: PYTHONPATH=<tree> python recover_scale.py MIB PATH"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd import recovery

WALK: dict[str, float] = {}
_walk = recovery._walk


def _timed_walk(*a, **k):  # noqa: ANN002, ANN003
    t0 = time.perf_counter()
    try:
        return _walk(*a, **k)
    finally:
        WALK["s"] = time.perf_counter() - t0


recovery._walk = _timed_walk


def main() -> None:
    cap, path = int(sys.argv[1]) << 20, sys.argv[2]
    if not os.path.exists(path):
        seg = encode_segment(np.random.default_rng(0).standard_normal(16384).astype(np.float16), "none",
                             role="key", layer=0)
        t = SsdTier(SsdConfig(paths=(path,), capacity=cap))
        n = cap // (len(seg) + 4096)
        for i in range(n):
            assert t.submit(ObjectKey(b"n" * 16, chunk_key(i), 0, Role.KEY), seg, timeout=10.0)
        t.close()
    t0 = time.perf_counter()
    t = SsdTier(SsdConfig(paths=(path,), capacity=cap, recover=True))
    dt = time.perf_counter() - t0
    print(f"{cap >> 20} MiB shard: recovered {t.snapshot().objects} records in {dt:.2f} s, "
          f"of which the chain walk {WALK['s']:.2f} s")
    t.close()


if __name__ == "__main__":
    main()
