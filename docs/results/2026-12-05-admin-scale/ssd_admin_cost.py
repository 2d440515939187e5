"""The SSD tier under an admin's listing and a small tenant's invalidation, with N records of one namespace in one
shard (16 segments a chunk, 4 KiB segments: 8 KiB records, so that a shard holds many) and one chunk of a second
namespace:

* a page: `Manager.list_objects(limit=2)` over a DRAM tier of 64 KiB (empty: every row is the SSD's), the
  README's `GET /v1/objects?limit=1` with the next page's cursor; the first page and a page from a cursor in
  the middle of the keys;
* the tier's lock held by a page: the longest `SsdTier.contains` a second thread saw during those pages (every
  read, demotion and lookup of every engine takes that lock);
* `SsdTier.invalidate(namespace=<the second>)`: the other tenant's 16 records hidden, its tombstones written
  and synced, a checkpoint.

Medians of 5 calls. The shard file is written afresh by each run.

Usage: PYTHONPATH=<tree> python ssd_admin_cost.py DIR RECORDS..."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

PER = 16
NS, OTHER = b"n" * 16, b"o" * 16


def _stalls(t: SsdTier, stop: threading.Event, worst: list[float]) -> None:
    probe = ObjectKey(NS, chunk_key(0), 0, Role.KEY)
    while not stop.is_set():
        t0 = time.perf_counter()
        t.contains(probe)
        worst[0] = max(worst[0], time.perf_counter() - t0)
        time.sleep(0.0005)


def main() -> None:
    d = sys.argv[1]
    x = np.random.default_rng(0).standard_normal(2048).astype(np.float16)
    segs = [encode_segment(x, "none", role="key", layer=i) for i in range(PER)]
    for n in map(int, sys.argv[2:]):
        path = os.path.join(d, f"admin-{os.getpid()}.okv")
        t = SsdTier(SsdConfig(paths=(path,), capacity=(n + 5 * PER) * 8192 + (64 << 20)))
        try:
            for c in range(n // PER):
                for i in range(PER):
                    assert t.submit(ObjectKey(NS, chunk_key(c), i, Role.KEY), segs[i], timeout=10.0)
            t.flush()
            with Manager(ManagerConfig(pool_size=64 << 10), lower_tier=t) as m:
                pages, worst = {"first": [], "middle": []}, [0.0]
                middle = f"lower:{ObjectKey(NS, chunk_key(7), 3, Role.KEY).pack().hex()}"
                stop = threading.Event()
                th = threading.Thread(target=_stalls, args=(t, stop, worst))
                th.start()
                try:
                    for _ in range(5):
                        for name, cursor in (("first", None), ("middle", middle)):
                            t0 = time.perf_counter()
                            page = m.list_objects(limit=2, cursor=cursor)
                            pages[name].append(time.perf_counter() - t0)
                            assert len(page.objects) == 2 and page.next_cursor, page
                finally:
                    stop.set()
                    th.join()
                inval = []
                for j in range(5):
                    for i in range(PER):
                        assert t.submit(ObjectKey(OTHER, chunk_key(j), i, Role.KEY), segs[i], timeout=10.0)
                    t.flush()
                    t0 = time.perf_counter()
                    r = t.invalidate(namespace=OTHER)
                    inval.append(time.perf_counter() - t0)
                    assert r.objects == PER, r
            print(f"{n:>8} records: a page {statistics.median(pages['first']) * 1e3:.1f} ms (first), "
                  f"{statistics.median(pages['middle']) * 1e3:.1f} ms (from a cursor); the tier's lock held "
                  f"{worst[0] * 1e3:.1f} ms at most; another namespace invalidated in "
                  f"{statistics.median(inval) * 1e3:.1f} ms")
        finally:
            t.close()
            os.unlink(path)


if __name__ == "__main__":
    main()
