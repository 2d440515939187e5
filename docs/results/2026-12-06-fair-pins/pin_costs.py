"""What the namespaces' parts cost the DRAM tier, in one process (PYTHONPATH picks the tree): a lookup's first pin
of 64 chunks of 72 segments (the issue's geometry), and an eviction walk past the share that must take 512 pinned
objects (of one namespace's 2,048 pinned, another namespace's 64 under its part; then the 64 in the same
namespace, the least recent, taken first). Median of REPEAT.

Usage: python pin_costs.py [REPEAT]"""

from __future__ import annotations

import logging
import statistics
import sys
import time

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import UNIT, DramTier


def key(ns: bytes, c: int, layer: int = 0) -> bytes:
    return ObjectKey(ns * 16, c.to_bytes(16, "little"), layer, Role.KEY).pack()


def first_pin() -> float:
    t = DramTier(64 * 72 * 2 * UNIT, pin_share=1.0)
    try:
        for c in range(64):
            for layer in range(72):
                assert t.publish(key(b"a", c, layer), t.reserve(1000), 1000, 1000, 0) is not None
        chunks = [key(b"a", c)[:32] for c in range(64)]
        t0 = time.perf_counter()
        t.pin_chunks(chunks)
        return time.perf_counter() - t0
    finally:
        t.close()


def walk(other: bytes = b"v") -> float:
    t = DramTier(4224 * UNIT, pin_share=0.5)  # 2,112 objects of 2 units: pins keep 1,056 objects
    try:
        for c in range(10**6, 10**6 + 64):
            assert t.publish(key(other, c), t.reserve(1000), 1000, 1000, 0) is not None
        t.pin_chunks([key(other, c)[:32] for c in range(10**6, 10**6 + 64)])
        for c in range(2048):
            assert t.publish(key(b"a", c), t.reserve(1000), 1000, 1000, 0) is not None
        t.pin_chunks([key(b"a", c)[:32] for c in range(2048)])
        t0 = time.perf_counter()
        with t.lock:
            n = t._evict(512 * 2)
        took = time.perf_counter() - t0
        kept = all(t.contains(key(other, c)) for c in range(10**6, 10**6 + 64))
        assert n == 512 and kept is (other != b"a" and "ns_pinned" in vars(t)), n
        return took
    finally:
        t.close()


logging.disable(logging.WARNING)  # the pinned-eviction warning, once per walk here
repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 30
for name, f in (("first pin, 64 chunks x 72 segments", first_pin),
                ("eviction walk over the share, 512, two namespaces", walk),
                ("the same, one namespace", lambda: walk(b"a"))):
    print(f"{name}: {1e6 * statistics.median(f() for _ in range(repeat)):.1f} us")
