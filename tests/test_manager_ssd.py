"""Manager over the real SSD tier (io_uring log file): demotion on eviction, flush, promotion on lookup,
restore from SSD, invalidation across tiers, listing."""

from __future__ import annotations

import numpy as np
import pytest

from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.keys import chunk_key

from test_manager import L, assert_reservations_zero, chunks_for, make_engine, snapshot, zero

ssd = pytest.importorskip("orbitkv_fs.tiers.ssd")


@pytest.fixture
def tier(tmp_path):
    try:
        t = ssd.SsdTier(ssd.SsdConfig(paths=(str(tmp_path / "log0"),), capacity=32 << 20))
    except OSError as e:  # io_uring unavailable in this sandbox
        pytest.skip(f"SSD tier unavailable: {e}")
    return t


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_demote_flush_promote_restore(tier, codec):
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=256 << 10, storage_codec=codec), lower_tier=tier) as m:
            e = m.register_engine(reg)
            ch = chunks_for(8)
            m.save(e.engine_id, ch)  # about 2x the pool (none): the oldest chunks go to SSD
            st = m.stats()
            assert st.evictions > 0 and st.demoted == st.evictions
            f = m.flush_dram()
            assert f.submitted.objects > 0 and f.dropped.objects == 0
            assert m.stats().pool_used_bytes == 0
            assert m.stats().lower  # the tier's own stats ride along
            lk = m.lookup(e.engine_id, [c.key for c in ch[:2]])
            assert (lk.count, lk.lower, lk.dram) == (2, 2, 0)  # promoted back into DRAM, leased
            zero(pages)
            res = m.restore(e.engine_id, ch, lease_id=lk.lease_id)  # ch[2:] straight from SSD
            assert all(res.restored), res.misses
            for name in pages.tensors:
                got, want = pages.array(name)[:16], orig[name][:16]
                if codec == "none":
                    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
                else:
                    assert np.all(np.abs(got.astype(np.float32) - want.astype(np.float32))
                                  <= np.abs(want.astype(np.float32)) / 16 + 2.0 ** -9)
            st = m.stats()
            assert st.hits["lower"] > 0
            listing = m.list_objects(bytes.fromhex(e.namespace), limit=100_000)
            assert {o.tier for o in listing.objects} == {"dram", "lower"}
            ndram = sum(o.tier == "dram" for o in listing.objects)
            for limit in (7, ndram):  # pages are the listing cut, across the tiers (one page ends with DRAM's rows)
                paged, cursor = [], None
                while True:
                    page = m.list_objects(bytes.fromhex(e.namespace), limit=limit, cursor=cursor)
                    paged += page.objects
                    if page.next_cursor is None:
                        break
                    assert len(page.objects) == limit
                    cursor = page.next_cursor
                assert paged == listing.objects, limit
            assert sum(o.tier == "lower" for o in listing.objects) > 7
            inv = m.invalidate(engine_id=e.engine_id)
            assert inv.lower.objects == 8 * 2 * L and inv.dram.objects > 0
            assert m.lookup(e.engine_id, [ch[0].key], lease=False).count == 0
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_full_dram_of_leases_saves_to_ssd(tier):
    pages, reg = make_engine()
    try:
        with Manager(ManagerConfig(pool_size=128 << 10), lower_tier=tier) as m:
            e = m.register_engine(reg)
            a = [ChunkBlocks(chunk_key("a"), [0, 1])]
            m.save(e.engine_id, a)
            lk = m.lookup(e.engine_id, [a[0].key])  # pins the only chunk that fits
            r = m.save(e.engine_id, chunks_for(1, base=4, salt="b"))
            assert r.dropped_segments == 0 and r.segments == 2 * L  # written through to SSD
            m.release(lk.lease_id)
            tier.flush()
            assert m.lookup(e.engine_id, [chunks_for(1, base=4, salt="b")[0].key], lease=False).count == 1
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_ssd_hit_restores_while_dram_is_full_of_pinned_chunks(tier):
    """A segment the SSD holds but DRAM cannot take back (every extent pinned) is restored from the SSD
    bytes directly."""
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=128 << 10), lower_tier=tier) as m:
            e = m.register_engine(reg)
            b = chunks_for(1, base=4, salt="b")
            m.save(e.engine_id, b)
            m.flush_dram()  # b lives on the SSD only
            a = [ChunkBlocks(chunk_key("a"), [0, 1])]
            m.save(e.engine_id, a)
            lk = m.lookup(e.engine_id, [a[0].key])  # pins the only chunk that fits
            zero(pages)
            res = m.restore(e.engine_id, b)
            assert res.restored == [True], res.misses
            for name in pages.tensors:
                assert np.array_equal(pages.array(name)[b[0].blocks].view(np.uint16),
                                      orig[name][b[0].blocks].view(np.uint16))
            st = m.stats()
            assert st.hits["lower"] == 2 * L
            assert st.resident_objects["dram"] < 2 * 2 * L  # some of b was served without being taken back
            m.release(lk.lease_id)
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_ssd_corruption_is_a_counted_miss_in_lookup_and_restore(tier):
    from test_ssd_common import flip

    pages, reg = make_engine()
    try:
        with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            ch = chunks_for(4)
            m.save(e.engine_id, ch)
            m.flush_dram()
            path = tier.config.paths[0]

            def damage(c) -> None:
                victim = next(o for o in tier.iter_records() if o.key.chunk == c.key)
                flip(path, victim.offset + 128 + 200)

            damage(ch[1])
            lk = m.lookup(e.engine_id, [c.key for c in ch[:3]], lease=False)
            assert (lk.count, lk.lower) == (1, 1)
            assert m.stats().misses == 1  # the bad segment the lookup read
            assert_reservations_zero(m)  # the bad segment's extent, reserved with its window, was given back
            assert tier.snapshot().corrupt_records_total == 1
            # The window's reads land in DRAM as they arrive: chunk 2, read beside the corrupt chunk 1, is
            # not counted but stays in DRAM, where a later lookup finds it without the SSD.
            reads = tier.snapshot().read_total
            again = m.lookup(e.engine_id, [ch[2].key], lease=False)
            assert (again.count, again.dram, again.lower) == (1, 1, 0) and tier.snapshot().read_total == reads
            damage(ch[3])
            m.flush_dram()  # chunks 0 and 2 leave DRAM again; their SSD records are intact
            res = m.restore(e.engine_id, ch[3:])
            assert res.restored == [False]
            assert res.misses[0].reason.startswith("lower tier: record failed validation")
            st = m.stats()
            assert st.misses == 2 and tier.snapshot().corrupt_records_total == 2
    finally:
        pages.close()


def test_evicting_a_promoted_chunk_writes_nothing(tier):
    """A chunk a lookup read back from the SSD is on disk already: when DRAM evicts it again (here a
    flush), the tier writes nothing, and the chunk still restores from the SSD."""
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            ch = chunks_for(2)
            m.save(e.engine_id, ch)
            m.flush_dram()
            written = tier.snapshot().write_submitted_total
            lk = m.lookup(e.engine_id, [c.key for c in ch], lease=False)
            assert (lk.count, lk.lower) == (2, 2)
            m.flush_dram()
            st = tier.snapshot()
            assert st.write_submitted_total == written
            assert st.write_already_stored_total == len(ch) * 2 * L
            zero(pages)
            assert m.restore(e.engine_id, ch).restored == [True, True]
            for name in pages.tensors:
                blocks = [b for c in ch for b in c.blocks]
                assert np.array_equal(pages.array(name)[blocks].view(np.uint16), orig[name][blocks].view(np.uint16))
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_lookup_counts_what_restore_serves_while_dram_is_full_of_pinned_chunks(tier):
    """DRAM full of pinned objects cannot take SSD chunks back; lookup (leased or not) still counts the
    chunks whose SSD records read back valid, because restore serves them from the SSD bytes."""
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=128 << 10, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            b = chunks_for(2, base=4, salt="b")
            m.save(e.engine_id, b)
            m.flush_dram()
            a = [ChunkBlocks(chunk_key("a"), [0, 1])]
            m.save(e.engine_id, a)
            pinned = m.lookup(e.engine_id, [a[0].key])
            for lease in (False, True):
                lk = m.lookup(e.engine_id, [c.key for c in b], lease=lease)
                assert (lk.count, lk.lower) == (2, 2)
                zero(pages)
                res = m.restore(e.engine_id, b, lease_id=lk.lease_id)
                assert res.restored == [True, True], res.misses
                for name in pages.tensors:
                    blocks = [x for c in b for x in c.blocks]
                    assert np.array_equal(pages.array(name)[blocks].view(np.uint16),
                                          orig[name][blocks].view(np.uint16))
            assert m.stats().misses == 0
            m.release(pinned.lease_id)
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_lookup_that_fails_in_the_lower_tier_leaves_no_pins(tier, monkeypatch):
    """A lookup whose lower-tier read raises (an io_uring failure) fails, and hands back the chunk pins it
    took on the DRAM run and the promotion window: nothing stays pinned for a lease nobody got."""
    pages, reg = make_engine()
    try:
        with Manager(ManagerConfig(pool_size=256 << 10, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            a, b = chunks_for(1, base=0, salt="a"), chunks_for(1, base=4, salt="b")
            m.save(e.engine_id, b)
            m.flush_dram()  # b lives on the SSD only
            m.save(e.engine_id, a)  # a in DRAM: the lookup pins it, then promotes b

            real = tier.read_many
            for landed in (0, 3):  # the ring fails at once, or after three segments landed (copied into DRAM)

                def failing(keys, sink=None, landed=landed):
                    if landed:
                        real(keys[:landed], sink=sink)
                    raise ssd.SsdIoError(f"io_uring_enter: injected after {landed} reads")

                monkeypatch.setattr(tier, "read_many", failing)
                with pytest.raises(ssd.SsdIoError):
                    m.lookup(e.engine_id, [a[0].key, b[0].key])
                assert_reservations_zero(m)
                monkeypatch.undo()
            lk = m.lookup(e.engine_id, [a[0].key, b[0].key])
            assert (lk.count, lk.dram, lk.lower) == (2, 1, 1)
            m.release(lk.lease_id)
            assert_reservations_zero(m)
    finally:
        pages.close()


@pytest.mark.parametrize("sizes", ["told", "unknown", "wrong"])
def test_a_promotion_window_reserves_its_dram_at_once_from_the_sizes_the_tier_tells(tier, monkeypatch, sizes):
    """A lookup's promotion reserves the DRAM for a window's segments in one round, from the sizes the SSD
    tier knows before reading (``describe``), not one extent a segment as they land. A tier that cannot size
    its segments (no ``describe``: membership only), or a segment whose record changed size since (here: a
    tier that lies), gets an extent a segment; either way every segment is promoted whole and no reservation
    is left over."""
    pages, reg = make_engine()
    try:
        with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            ch = chunks_for(3)
            m.save(e.engine_id, ch)
            want = snapshot(pages)
            m.flush_dram()
            told = tier.describe
            if sizes == "unknown":
                monkeypatch.setattr(tier, "describe", None)
            elif sizes == "wrong":
                monkeypatch.setattr(tier, "describe", lambda keys: [(o, n + 4096) for o, n in told(keys)])
            ones = []
            real_reserve = m.dram.reserve
            monkeypatch.setattr(m.dram, "reserve", lambda n: ones.append(n) or real_reserve(n))
            lk = m.lookup(e.engine_id, [c.key for c in ch], lease=False)
            assert (lk.count, lk.dram, lk.lower) == (3, 0, 3)
            assert len(ones) == (0 if sizes == "told" else 3 * 2 * L)
            assert_reservations_zero(m)
            monkeypatch.undo()
            again = m.lookup(e.engine_id, [c.key for c in ch], lease=False)
            assert (again.count, again.dram, again.lower) == (3, 3, 0)  # every segment came back into DRAM whole
            zero(pages)
            res = m.restore(e.engine_id, ch)
            assert res.restored == [True] * 3, res.misses
            for name in pages.tensors:
                assert np.array_equal(pages.array(name)[:6].view(np.uint16), want[name][:6].view(np.uint16))
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_a_promotion_run_ends_at_the_first_chunk_the_tier_lacks_without_reading_it(tier):
    """The window is formed from what the tier holds (its ``describe``): the run stops before a chunk it lacks,
    which is neither read nor counted as a miss, nor is anything after it."""
    pages, reg = make_engine()
    try:
        with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=0), lower_tier=tier) as m:
            e = m.register_engine(reg)
            ch = chunks_for(3)
            m.save(e.engine_id, ch)
            m.flush_dram()
            absent = chunks_for(1, salt="absent")[0]
            before, misses = tier.snapshot().read_hits_total, m.stats().misses
            lk = m.lookup(e.engine_id, [ch[0].key, ch[1].key, absent.key, ch[2].key], lease=False)
            assert (lk.count, lk.dram, lk.lower) == (2, 0, 2)
            assert tier.snapshot().read_hits_total - before == 2 * 2 * L  # ch[0] and ch[1], nothing after
            assert m.stats().misses == misses
            assert_reservations_zero(m)
    finally:
        pages.close()
