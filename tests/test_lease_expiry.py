"""Lease expiry: a lookup whose engine never comes back for it (its client timed out, the reply was lost)
must not pin DRAM forever. After ``lease_ttl`` the housekeeping thread drops it: its chunks become
evictable again, it is counted (``leases_expired``, ``orbitkv_leases_expired_total``), a late restore
naming it is still served (under its own hold), a late release is a no-op; another engine's lease id is
still refused; with ``lease_ttl=0`` nothing expires."""

from __future__ import annotations

import time

import pytest

from orbitkv_fs.connectors.common import StagingPages
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, LeaseError, Manager, ManagerConfig
from metrics_text import prometheus_text
from polling import wait_until


def _engine(m: Manager):
    pages = StagingPages(num_layers=2, slots=16, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    pages.key(0)[...] = 1
    return pages, m.register_engine(pages.registration(model="m", engine_kind="test"))


def test_an_abandoned_lease_expires():
    with Manager(ManagerConfig(pool_size=8 << 20, device="cpu", lease_ttl=0.4, engine_check_interval=0)) as m:
        pages, e = _engine(m)
        other_pages, other = _engine(m)
        try:
            chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(4)]
            m.save(e.engine_id, chunks)
            kept = m.lookup(e.engine_id, [c.key for c in chunks])  # restored in time: never expires
            abandoned = m.lookup(e.engine_id, [c.key for c in chunks])
            assert kept.count == abandoned.count == 4
            assert all(m.restore(e.engine_id, chunks, lease_id=kept.lease_id).restored)
            assert m.stats().leases_active > 0
            assert wait_until(lambda: m.stats().leases_expired == 1)
            st = m.stats()
            assert (st.leases_active, st.pinned_chunks, st.leased_bytes, st.reserved_bytes) == (0, 0, 0, 0)
            assert (m._engines[e.engine_id].leases, m._engines[e.engine_id].leased_chunks) == ({}, 0)  # its books
            with pytest.raises(LeaseError):  # an expired lease of another engine is still not yours
                m.restore(other.engine_id, chunks, lease_id=abandoned.lease_id)
            res = m.restore(e.engine_id, chunks, lease_id=abandoned.lease_id)  # late, but served
            assert all(res.restored)
            m.release(abandoned.lease_id)  # late release: nothing left to drop, no error
            with pytest.raises(LeaseError):
                m.release(abandoned.lease_id + 1000)
            assert m.stats().leases_active == 0
            assert b"orbitkv_leases_expired_total 1.0" in prometheus_text(m)  # last: skips without the extra
        finally:
            pages.close()
            other_pages.close()


def test_no_expiry_with_ttl_zero():
    with Manager(ManagerConfig(pool_size=8 << 20, device="cpu", lease_ttl=0, engine_check_interval=0)) as m:
        pages, e = _engine(m)
        try:
            chunks = [ChunkBlocks(chunk_key("z"), [0])]
            m.save(e.engine_id, chunks)
            lk = m.lookup(e.engine_id, [chunks[0].key])
            time.sleep(0.5)
            st = m.stats()
            assert st.leases_expired == 0 and st.leases_active > 0
            m.release(lk.lease_id)
            assert m.stats().leases_active == 0
        finally:
            pages.close()


def test_bad_ttl_is_refused():
    with pytest.raises(ValueError):
        Manager(ManagerConfig(pool_size=8 << 20, device="cpu", lease_ttl=-1))
