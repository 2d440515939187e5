"""Lease bounds: anyone may register an engine over pages of its own, and each lookup of that engine takes a
lease that pins its run until a restore or a release ends it, or ``lease_ttl`` (300 s) passes. A process that
looks up without end and releases nothing grew the Manager by about 130 MB a second (46,000 leases of 1,024
chunks took it past 6 GB in 46 s; docs/results/2026-12-06-lease-flood). An engine now holds at most
``max_leases_per_engine`` leases and ``max_leased_chunks_per_engine`` chunks under them: its oldest leases end
first, as if expired (a restore under one still runs, on a hold of its own), and a lookup whose run alone is
over the chunk bound is answered without a lease. Other engines' leases are never touched."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from orbitkv_fs.connectors.common import StagingPages
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, LeaseError, Manager, ManagerConfig
from manager_process import ATTACKER_ENGINE, ManagerProcess, sample_engine_round_trip
from metrics_text import prometheus_text


def _engine(m: Manager, model: str = "m"):
    pages = StagingPages(num_layers=2, slots=16, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    pages.key(0)[...] = 1
    return pages, m.register_engine(pages.registration(model=model, engine_kind="test"))


def test_an_engine_past_its_lease_bounds_loses_its_own_oldest_leases_first():
    cfg = ManagerConfig(pool_size=8 << 20, device="cpu", lease_ttl=0, engine_check_interval=0,
                        max_leases_per_engine=3, max_leased_chunks_per_engine=8)
    with Manager(cfg) as m:
        pages, e = _engine(m)
        other_pages, o = _engine(m, model="other")  # another namespace: its pins are its own chunks
        try:
            chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(9)]
            keys = [c.key for c in chunks]
            m.save(e.engine_id, chunks)
            m.save(o.engine_id, chunks[:2])
            theirs = m.lookup(o.engine_id, keys[:2])
            l1, l2, l3 = (m.lookup(e.engine_id, keys[2 * i:2 * i + 2]) for i in range(3))
            st = m.stats()
            assert (st.leases_active, st.pinned_chunks, st.leases_displaced) == (4, 8, 0)
            l4 = m.lookup(e.engine_id, keys[:2])  # a fourth lease: the oldest (l1) ends
            assert l4.count == 2 and l4.lease_id
            assert (m.stats().leases_active, m.stats().leases_displaced) == (4, 1)
            l5 = m.lookup(e.engine_id, keys[4:8])  # 6 chunks held + 4 > 8: l2 ends too (the oldest now)
            st = m.stats()
            assert (st.leases_active, st.leases_displaced, st.leases_refused) == (4, 2, 0)
            assert st.pinned_chunks == 2 + 6  # theirs; e's l3 (c4, c5), l4 (c0, c1), l5 (c4-c7), each chunk once
            # A displaced lease reads as an expired one: its restore is served, its release is a no-op, and it
            # is still not another engine's.
            with pytest.raises(LeaseError):
                m.restore(o.engine_id, chunks[:2], lease_id=l1.lease_id)
            assert all(m.restore(e.engine_id, chunks[:2], lease_id=l1.lease_id).restored)
            m.release(l2.lease_id, engine_id=e.engine_id)
            # A run over the chunk bound by itself gets no lease; nothing of it stays pinned.
            whole = m.lookup(e.engine_id, keys)
            assert (whole.count, whole.lease_id) == (9, 0)
            st = m.stats()
            assert (st.leases_active, st.pinned_chunks, st.leases_refused) == (4, 8, 1)
            for lk in (theirs, l3, l4, l5):  # the other engine's lease was never touched; e's live ones are its own
                m.release(lk.lease_id)
            st = m.stats()
            assert (st.leases_active, st.pinned_chunks, st.leased_bytes) == (0, 0, 0)
            assert (m._engines[e.engine_id].leases, m._engines[e.engine_id].leased_chunks) == ({}, 0)  # its books
            text = prometheus_text(m)
            assert b"orbitkv_leases_displaced_total 2.0" in text and b"orbitkv_leases_refused_total 1.0" in text
        finally:
            pages.close()
            other_pages.close()


def test_unregistering_an_engine_ends_its_leases_within_the_bounds():
    """The engine's books go with it: a second registration of the same id starts from none."""
    cfg = ManagerConfig(pool_size=8 << 20, device="cpu", lease_ttl=0, engine_check_interval=0,
                        max_leases_per_engine=2, max_leased_chunks_per_engine=4)
    with Manager(cfg) as m:
        pages, e = _engine(m)
        try:
            chunks = [ChunkBlocks(chunk_key(f"u{i}"), [i]) for i in range(4)]
            m.save(e.engine_id, chunks)
            for _ in range(5):
                assert m.lookup(e.engine_id, [c.key for c in chunks[:2]]).lease_id
            assert (m.stats().leases_active, m.stats().leases_displaced) == (2, 3)
            lk = m.lookup(e.engine_id, [c.key for c in chunks[2:]])
            assert all(m.restore(e.engine_id, chunks[2:], lease_id=lk.lease_id).restored)  # consumes it
            books = m._engines[e.engine_id]  # the engine's books name only live leases and their chunks
            assert set(books.leases) <= set(m._leases) and books.leased_chunks == sum(books.leases.values()) == 2
            m.unregister_engine(e.engine_id)
            st = m.stats()
            assert (st.leases_active, st.pinned_chunks) == (0, 0)
        finally:
            pages.close()


def test_bad_lease_bounds_are_refused():
    for bad in ({"max_leases_per_engine": 0}, {"max_leased_chunks_per_engine": 0}):
        with pytest.raises(ValueError):
            Manager(ManagerConfig(pool_size=8 << 20, device="cpu", **bad))


ATTACKER = ATTACKER_ENGINE + """
seconds = float(args[0])
chunks = [ChunkBlocks(chunk_key(f"a{i}"), [i]) for i in range(n)]
c.save("attacker", chunks)
keys = [ch.key for ch in chunks]
print("ready", flush=True)
calls = leased = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    lk = c.lookup("attacker", keys)
    calls += 1
    leased += lk.lease_id != 0
print(calls, leased)
"""


def test_a_process_that_looks_up_without_end_and_never_releases_costs_bounded_memory(tmp_path):
    """A second OS process, no token: registers an engine over its own pages, saves 1,024 chunks, then takes a
    lease on all of them as fast as the data plane answers, for 6 s, releasing none. At the defaults the
    Manager keeps 64 such leases (65,536 chunks); before the bound each one stayed for the lease TTL (300 s),
    about 85 KB each: some 7,000 leases, 600 MB, in these 6 s on the development VM. The Manager's memory is
    compared between 2 s into the flood and its end (its first seconds also fault in the attacker's pages,
    arena pages and per-thread allocator arenas: 40-100 MiB, more on a host with more cores). A second engine
    then saves and restores as usual."""
    mgr = ManagerProcess(shm_dir=str(tmp_path), pool="64mb")
    try:
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, mgr.endpoint, str(tmp_path), "1024", "6"],
                                    stdout=subprocess.PIPE, text=True)
        assert attacker.stdout.readline().strip() == "ready"
        time.sleep(2.0)
        early = mgr.rss()
        calls, leased = map(int, attacker.communicate(timeout=60)[0].split())
        assert attacker.returncode == 0
        grown = mgr.rss() - early
        assert leased == calls and calls > 200, (calls, leased)  # it did take a lease each time
        assert mgr.metric("orbitkv_leases_active") == 64
        assert mgr.metric("orbitkv_pinned_chunks") == 1024  # each chunk once, however many leases pin it
        assert mgr.metric("orbitkv_leases_displaced_total") == calls - 64
        assert grown < 32 << 20, f"the Manager grew {grown >> 20} MiB in the flood's last 4 s ({calls} lookups)"
        assert "its oldest leases end early" in mgr.log and mgr.log.count("its oldest leases end early") <= 2
        sample_engine_round_trip(mgr.endpoint, str(tmp_path))
        with urllib.request.urlopen(mgr.http + "/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        started = time.monotonic()
        assert mgr.stop() == 0
        assert time.monotonic() - started < 30
