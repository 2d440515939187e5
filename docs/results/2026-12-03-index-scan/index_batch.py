"""The index's batch steps at a save's and a restore's sizes, in the bench's steady state: ObjectIndex.add_many of the
batches of one 2,304-segment save (four of 504 keys and one of 288: whole chunks of 36 layers x 2 roles) into an
index whose rows come back from the free list (the bench invalidates everything before each save), then
get_many of the same keys in 512-key batches. Median and minimum microseconds per batch over ROUNDS saves, the
first 10 left out (numba's compile or cache load). Usage: [PYTHONPATH=TREE] python index_batch.py [ROUNDS]"""
import statistics as st
import sys
import time

import numpy as np

from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import chunk_key, key_tails, segment_keys

TAILS = key_tails([(layer, role) for layer in range(36) for role in (0, 1)])
SIZES = (504, 504, 504, 504, 288)


def _keys(chunks: range) -> list[bytes]:
    out: list[bytes] = []
    for c in chunks:
        out += segment_keys(bytes(16), chunk_key(c), TAILS)
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    idx = ObjectIndex()
    add: dict[int, list[float]] = {n: [] for n in set(SIZES)}
    get: list[float] = []
    for r in range(rounds):
        slots: list[int] = []
        every: list[bytes] = []
        c0 = r * 40
        for n in SIZES:
            keys = _keys(range(c0, c0 + n // 72))
            c0 += n // 72
            cols = (np.arange(n) * 128, np.full(n, 128), np.full(n, 524352), np.full(n, 524288), np.zeros(n, np.int64))
            t = time.perf_counter()
            got = idx.add_many(keys, *cols)
            add[n].append(time.perf_counter() - t)
            assert (got >= 0).all()
            slots += got.tolist()
            every += keys
        for i in range(0, len(every), 512):
            t = time.perf_counter()
            found = idx.get_many(every[i:i + 512])
            get.append(time.perf_counter() - t)
            assert (found >= 0).all()
        idx.hide_many(slots)
        idx.free_many(slots)
    for name, ts in [(f"add_many {n} keys", add[n]) for n in sorted(add)] + [("get_many 512 keys", get)]:
        ts = ts[10 * len(ts) // rounds:]
        print(f"{name:20s} median {st.median(ts) * 1e6:6.1f} us  min {min(ts) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
