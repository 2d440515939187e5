"""Host cost of leasing and checking a restore in two parts (the early first batch) against one, on this machine,
without a GPU: a Manager on host pages (the bench's geometry: 36 layers, 32 chunks of 16 blocks, 512 KiB segments,
2,304 segments), saved once; then ``_acquire`` with spans, ``_check_device_batch`` and ``_Rows.of`` as
``RestorePipeline.restore`` runs them on the GPU path, whole or split after ``--head`` chunks (what
``_early_head`` gives for ``batch_segments`` 512), and the drop of the hold. Then a few single numpy steps of
a save batch's publish (461 rows). Prints medians of ``--repeat`` runs, microseconds.

Usage: python split_cost.py [--head 8] [--repeat 300]"""

from __future__ import annotations

import argparse
import contextlib
import os
import timeit

import numpy as np

from orbitkv_fs.keys import chunk_key, segment_keys
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.manager.leases import Spans, _Lease
from orbitkv_fs.manager.restore import _Rows
from orbitkv_fs.tools import bench_pipeline as B


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", type=int, default=8)
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args()
    layers, blocks, per = 36, 512, 16
    order = np.arange(blocks)
    np.random.default_rng(1).shuffle(order)
    with contextlib.ExitStack() as stack:  # the pages file and the arena go, however this ends
        pages, reg = B._engine(blocks, layers)
        stack.callback(pages.close)
        m = stack.enter_context(Manager(ManagerConfig(
            pool_size=2 * blocks * B.BLOCK_BYTES * layers * 2 + (64 << 20), storage_codec="none")))
        e = m.register_engine(reg)
        chunks = [ChunkBlocks(chunk_key(f"x-{i}"), order[i * per:(i + 1) * per].tolist()) for i in range(blocks // per)]
        m.save(e.engine_id, chunks)
        eng = m._engines[e.engine_id]
        segs = eng.segs
        keys = [segment_keys(eng.ns, ch.key, eng.tails) for ch in chunks]
        kbs = [k for ks in keys for k in ks]

        def acquire(ks: list, held: _Lease) -> Spans:
            spans = Spans()
            m._acquire(ks, held, {}, {"lower": 0}, set(), None, spans)
            return spans

        def whole() -> None:
            held = _Lease(e.engine_id)
            spans = acquire(kbs, held)
            _, heads, sizes = m._check_device_batch(chunks, segs, keys, spans)
            _Rows.of(chunks, segs, keys, heads, sizes)
            m._drop_lease(held)

        def split() -> None:
            held, h, n0 = _Lease(e.engine_id), args.head, args.head * len(segs)
            spans = acquire(kbs[:n0], held)
            first = m._check_device_batch(chunks[:h], segs, keys[:h], spans)
            _Rows.of(chunks[:h], segs, keys[:h], first[1], first[2])  # _start_early's rows
            rest = acquire(kbs[n0:], held)
            spans = spans.joined(rest)
            tail = m._check_device_batch(chunks[h:], segs, keys[h:], rest)
            _, heads, sizes = (np.concatenate((a, b)) for a, b in zip(first, tail))
            _Rows.of(chunks, segs, keys, heads, sizes)
            m._drop_lease(held)

        def median_us(f, n: int = args.repeat) -> float:
            return float(np.median(timeit.repeat(f, number=1, repeat=n))) * 1e6

        for _ in range(2):  # twice, alternating: the second pair is the one to read
            print(f"{len(kbs)} segments: lease + checks + rows + drop, whole {median_us(whole):.0f} us, "
                  f"split after {args.head} chunks {median_us(split):.0f} us")
    n = 461
    reason = np.zeros(n, np.int64)
    reason[::9] = 2
    reps = np.full(n, 3, np.int64)
    reps[::9] = 0
    keys36 = [os.urandom(36) for _ in range(n)]
    for name, f in (("np.unique of raw reasons", lambda: np.unique(reason[reason != 0], return_counts=True)),
                    ("np.unique of formats, inverse", lambda: np.unique(reps, return_inverse=True)),
                    ("set of the batch's keys", lambda: set().update(keys36))):
        print(f"{n}-row save batch step: {name} {min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
