"""`--ssd-recover` of a tier of several shard files full of 32 KiB segments' records (the README's production
start has two shards), timed. The first call with a set of paths writes them (the tier's own submit, then a clean
close); later calls, with any tree, only recover them (a recovery that writes nothing leaves the records as they
were).

Usage: PYTHONPATH=<tree> python recover_shards.py MIB_PER_SHARD PATH..."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier


def main() -> None:
    paths = tuple(sys.argv[2:])
    cap = (int(sys.argv[1]) << 20) * len(paths)
    if not all(os.path.exists(p) for p in paths):
        seg = encode_segment(np.random.default_rng(0).standard_normal(16384).astype(np.float16), "none",
                             role="key", layer=0)
        t = SsdTier(SsdConfig(paths=paths, capacity=cap))
        for i in range(cap // (len(seg) + 4096)):
            assert t.submit(ObjectKey(b"n" * 16, chunk_key(i), 0, Role.KEY), seg, timeout=10.0)
        t.close()
    t0 = time.perf_counter()
    t = SsdTier(SsdConfig(paths=paths, capacity=cap, recover=True))
    dt = time.perf_counter() - t0
    print(f"{len(paths)} shards of {cap // len(paths) >> 20} MiB: recovered {t.snapshot().objects} records in "
          f"{dt:.2f} s ({cap / dt / 1e9:.2f} GB/s)")
    t.close()


if __name__ == "__main__":
    main()
