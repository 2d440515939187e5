"""How to gather 2,304 segment headers (64 bytes each) from offsets spread over a 1.3 GB buffer, as the restore's
size checks do from the arena: numpy's fancy index of 64-byte rows, a numba loop by bytes, a numba loop by 64-bit
words, and a numba loop that touches one byte of each (the cache and TLB misses alone). Usage: gather_micro.py"""
import time

import numba
import numpy as np


@numba.njit(nogil=True, boundscheck=False)
def by_bytes(buf, offs, heads):
    for k in range(offs.shape[0]):
        o = offs[k]
        for b in range(64):
            heads[k, b] = buf[o + b]


@numba.njit(nogil=True, boundscheck=False)
def by_words(buf64, offs, heads64):
    for k in range(offs.shape[0]):
        o = offs[k] >> 3
        for w in range(8):
            heads64[k, w] = buf64[o + w]


@numba.njit(nogil=True, boundscheck=False)
def touch(buf, offs):
    s = 0
    for k in range(offs.shape[0]):
        s += buf[offs[k]]
    return s


def timed(f, *a) -> float:
    t = time.perf_counter()
    for _ in range(200):
        f(*a)
    return (time.perf_counter() - t) / 200 * 1e6


buf = np.zeros(1300 << 20, np.uint8)
buf[::4096] = 1  # every page backed
n = 2304
offs = (np.random.default_rng(0).permutation(n) * (520 << 10)).astype(np.int64)  # a 512 KiB segment's stride
heads = np.zeros((n, 64), np.uint8)
rows = buf[:len(buf) // 64 * 64].reshape(-1, 64)
by_bytes(buf, offs, heads), by_words(buf.view(np.uint64), offs, heads.view(np.uint64)), touch(buf, offs)
for _ in range(3):
    print(f"numpy rows {timed(lambda: rows[offs // 64]):.0f} us, numba bytes {timed(by_bytes, buf, offs, heads):.0f}, "
          f"numba words {timed(by_words, buf.view(np.uint64), offs, heads.view(np.uint64)):.0f}, "
          f"touch only {timed(touch, buf, offs):.0f}")
