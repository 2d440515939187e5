"""ObjectIndex.add_many in steady state (every slot from the free list, freed in slot order as an
invalidation of everything leaves it), per key, for the two shapes the save paths publish: chunks of 16
segments (the CPU bench: 8 layers x K, V) and of 72 (36 layers: the GPU bench at 512 KiB), in batches of 256
and 512 keys (the previous and the new default of batch_segments); best of 30 rounds.
Usage: PYTHONPATH=TREE python index_add.py (from outside the checkout)."""

from __future__ import annotations

import time

from orbitkv_fs.geometry import Role
from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import chunk_key, pack_key


def steady(layers: int, batch: int, chunks: int) -> float:
    keys = [pack_key(bytes(16), chunk_key(f"c{c}"), lay, r) for c in range(chunks) for lay in range(layers)
            for r in (Role.KEY, Role.VALUE)]
    ix = ObjectIndex()

    def fill() -> None:
        for i in range(0, len(keys), batch):
            b = keys[i:i + batch]
            k = len(b)
            ix.add_many(b, list(range(i, i + k)), [1] * k, [100] * k, [100] * k, [1] * k)

    def empty() -> None:
        for s in sorted(ix.slots()):
            ix.hide(s)
            ix.free(s)

    fill()
    empty()
    best = float("inf")
    for _ in range(30):
        t = time.perf_counter()
        fill()
        best = min(best, time.perf_counter() - t)
        empty()
    return best / len(keys) * 1e6


if __name__ == "__main__":
    for layers, chunks in ((8, 128), (36, 64)):
        for batch in (256, 512):
            print(f"chunks of {2 * layers} segments, batches of {batch} keys: {steady(layers, batch, chunks):.3f} us/key")
