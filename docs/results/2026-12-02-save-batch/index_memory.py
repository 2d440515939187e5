"""Heap bytes per segment of the index (and index + LRU) filled by ``add`` one key at a time against
``add_many`` of save batches (32 chunks), same keys, tracemalloc; a batch's own lists are freed before the
next one. ``orbitkv-bench pipeline --only index`` measures the ``add`` path.

    python docs/results/2026-12-02-save-batch/index_memory.py 1000000 2
"""

from __future__ import annotations

import sys
import tracemalloc

from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.eviction import make_policy

n = int(sys.argv[1])
ns = bytes(16)
for per in [int(x) for x in sys.argv[2].split(",")]:
    layers = per // 2 or 1
    tails = [ObjectKey(ns, ns, s % layers, Role.KEY if s < layers else Role.VALUE).pack()[32:] for s in range(per)]
    for mode in ("add", "add_many"):
        for pol_name in (None, "lru"):
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            ix = ObjectIndex()
            pol = make_policy(pol_name) if pol_name else None
            i = 0
            while i < n:
                ks = [ns + ((i // per) + c).to_bytes(16, "little") + t for c in range(32) for t in tails][:n - i]
                m = len(ks)
                if mode == "add":
                    slots = [ix.add(k, i + j, 2, 1000, 2000, 0)[0] for j, k in enumerate(ks)]
                    if pol is not None:
                        for s, k in zip(slots, ks):
                            pol.insert(s, 1024, hash(k))
                else:
                    slots = ix.add_many(ks, range(i, i + m), [2] * m, [1000] * m, [2000] * m, [0] * m)
                    if pol is not None:
                        pol.insert_many(slots, [1024] * m, map(hash, ks))
                del ks, slots
                i += m
            used = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            print(f"segments {n} per_chunk {per} {mode} {pol_name or 'index'}: {used / n:.1f} B/segment", flush=True)
            del ix, pol
