"""The index's batch step (ObjectIndex.add_many) of one save batch of new chunks, best of 60, at 254 and 512 segments
(36 layers x 2 roles per chunk): its fixed and per-key parts. Usage: PYTHONPATH=TREE python index_micro.py"""
import time, numpy as np, sys
from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import segment_keys, chunk_key, key_tails
ns = bytes(16)
tails = key_tails([(l, r) for l in range(36) for r in (0, 1)])
def batch(nchunks, c0):
    keys = []
    for c in range(c0, c0 + nchunks):
        keys += segment_keys(ns, chunk_key(c), tails)
    return keys
for nseg in (72*3+38, 512):
    best = 1e9
    for rep in range(60):
        idx = ObjectIndex()
        # fill with some prior objects
        prior = batch(40, 10**6)
        idx.add_many(prior, np.arange(len(prior))*128, np.full(len(prior),128), np.full(len(prior),524352), np.full(len(prior),524288), np.zeros(len(prior),np.int64))
        keys = batch(-(-nseg//72), rep*100)[:nseg]
        n=len(keys); off=np.arange(n)*128+10**6
        t=time.perf_counter()
        idx.add_many(keys, off, np.full(n,128), np.full(n,524352), np.full(n,524288), np.zeros(n,np.int64))
        best=min(best,time.perf_counter()-t)
    print(nseg, f"{best*1e6:.1f} us  {best*1e6/nseg:.3f} us/key")
