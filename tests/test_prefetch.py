"""Speculative SSD prefetch on real O_DIRECT files and real io_uring: the tier's background lane (validated
reads to a sink, byte bounds, corrupt records dropped and invalidated, no read started while a demand
read runs) and the Manager's readahead along a prefix (counters: prefetched segments and bytes, hits,
wasted)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.tiers.ssd import RECORD_HEADER_SIZE, SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import record_length
from polling import wait_until
from test_manager import L, assert_reservations_zero, chunks_for, make_engine, snapshot, zero
from test_ssd_common import direct_io_dir, flip, key, segment


@pytest.fixture
def ssd_dir(tmp_path):
    return direct_io_dir(tmp_path)


def make(ssd_dir, **kw) -> SsdTier:
    return SsdTier(SsdConfig(paths=(str(ssd_dir / "shard0.okv"),), capacity=32 << 20, **kw))


class Sink:
    def __init__(self) -> None:
        self.got: dict = {}
        self.kinds: set = set()
        self.cond = threading.Condition()

    def __call__(self, k, seg: bytes) -> None:
        with self.cond:
            self.got[k] = bytes(seg)  # a view valid during the call only
            self.kinds.add(type(seg))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), self.got.keys()


def stored(t: SsdTier, n: int) -> list:
    """Keys of ``n`` segments written to ``t`` (submitted and flushed)."""
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        t.submit(k, segment(i))
    t.flush()
    return keys


def test_lane_reads_validated_segments_into_the_sink(ssd_dir):
    with make(ssd_dir) as t:
        keys = [key(i) for i in range(6)]
        segs = {k: segment(i) for i, k in enumerate(keys)}
        for k in keys:
            assert t.submit(k, segs[k])
        t.flush()
        sink = Sink()
        assert t.prefetch(keys[:4] + [key(99)], sink) == 4  # the absent key is skipped
        sink.wait_for(4)
        assert sink.got == {k: segs[k] for k in keys[:4]}
        assert sink.kinds == {memoryview}  # views of the lane's window: no copy a record the sink may not keep
        s = t.snapshot()
        assert s.prefetch_requested_total == 4 and s.prefetch_read_total == 4
        assert s.prefetch_read_bytes_total == sum(len(segs[k]) for k in keys[:4])
        # A per-call byte bound: only the first record fits, the second is dropped (counted).
        one = record_length(len(segs[keys[4]]))
        assert t.prefetch(keys[4:6], Sink(), max_bytes=one) == 1
        assert t.snapshot().prefetch_dropped_total == 1
        assert t.stats()["ssd_prefetch_read_total"] >= 4


@pytest.mark.parametrize("depth", [1, 4])
def test_a_window_of_records_apart_takes_what_the_ring_has_reads_for_and_the_rest_waits(ssd_dir, depth):
    """Every other record of a shard (none end to end): a window holds as many records as the lane's ring has
    reads for (``prefetch_queue_depth``); the others go back to the head of the queue and are read in later
    windows, none lost, none read twice, every lease given back."""
    with make(ssd_dir, prefetch_queue_depth=depth) as t:
        keys = stored(t, 24)[::2]
        sink = Sink()
        assert t.prefetch(keys, sink) == len(keys)
        sink.wait_for(len(keys))
        assert sink.got == {k: segment(2 * i) for i, k in enumerate(keys)}
        s = t.snapshot()
        assert s.prefetch_read_total == len(keys) and s.prefetch_errors_total == 0 and s.prefetch_dropped_total == 0
        assert wait_until(lambda: all(sl.leases == 0 for sh in t._shards for sl in sh.slots.values()))
        assert not t._pf_keys and t._pf_bytes == 0


def test_lane_is_off_with_zero_bytes(ssd_dir):
    with make(ssd_dir, prefetch_max_bytes=0) as t:
        t.submit(key(1), segment(1))
        t.flush()
        assert t.prefetch([key(1)], Sink()) == 0


def test_corrupt_record_is_dropped_and_invalidated(ssd_dir):
    with make(ssd_dir) as t:
        keys = stored(t, 3)
        victim = next(o for o in t.iter_records() if o.key == keys[1])
        flip(str(ssd_dir / "shard0.okv"), victim.offset + RECORD_HEADER_SIZE + 300)
        sink = Sink()
        assert t.prefetch(keys, sink) == 3
        assert wait_until(lambda: t.snapshot().prefetch_read_total + t.snapshot().corrupt_records_total == 3)
        assert set(sink.got) == {keys[0], keys[2]}
        assert not t.contains(keys[1])  # that generation is gone for every reader
        assert t.snapshot().corrupt_records_total == 1
        assert t.read(keys[1]) is None and t.read(keys[0]) == segment(0)


def test_lane_starts_nothing_while_a_demand_read_runs(ssd_dir):
    with make(ssd_dir) as t:
        keys = stored(t, 4)
        inside, release = threading.Event(), threading.Event()

        def slow_consumer(i: int, seg: bytes) -> None:  # holds the demand read open
            inside.set()
            assert release.wait(10)

        reader = threading.Thread(target=t.read_many, args=([keys[0]],), kwargs={"sink": slow_consumer})
        reader.start()
        try:
            assert inside.wait(10)
            sink = Sink()
            assert t.prefetch(keys[1:], sink) == 3
            time.sleep(0.3)
            assert sink.got == {} and t.snapshot().prefetch_read_total == 0
        finally:
            release.set()
            reader.join()
        sink.wait_for(3)


def test_close_with_queued_prefetches(ssd_dir):
    t = make(ssd_dir)
    keys = stored(t, 32)
    t.prefetch(keys, Sink())
    t.close()  # must not hang nor leave reads in flight


# ------------------------------------------------------------------------------------------ Manager


@pytest.fixture
def tier(ssd_dir):
    return make(ssd_dir)


@pytest.fixture
def engine():
    pages, reg = make_engine()
    yield pages, reg
    pages.close()


def _on_ssd_only(m: Manager, eng_id: str, chunks) -> None:
    m.save(eng_id, chunks)  # one save: the chunks are remembered as one prefix, in order
    m.flush_dram()
    assert m.stats().resident_objects["dram"] == 0


def test_restore_reads_ahead_along_the_prefix(tier, engine):
    pages, reg = engine
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=2), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(6)
        _on_ssd_only(m, e.engine_id, ch)
        zero(pages)
        assert all(m.restore(e.engine_id, ch[:2]).restored)  # SSD hits: chunks 2 and 3 are read ahead
        assert wait_until(lambda: m.stats().prefetch_segments == 2 * 2 * L)
        st = m.stats()
        assert st.prefetch_bytes > 0 and st.prefetch_hits == 0
        assert m.lookup(e.engine_id, [c.key for c in ch[2:4]], lease=False).dram == 2
        lower_hits = m.stats().hits["lower"]
        res = m.restore(e.engine_id, ch[2:4])  # served by the prefetched objects
        assert all(res.restored)
        st = m.stats()
        assert st.hits["lower"] == lower_hits and st.prefetch_hits == 2 * 2 * L
        # ... and the readahead went on to chunks 4 and 5.
        assert wait_until(lambda: m.stats().prefetch_segments == 4 * 2 * L)
        for name in pages.tensors:
            blocks = [b for c in ch[:4] for b in c.blocks]
            assert np.array_equal(pages.array(name)[blocks].view(np.uint16),
                                  orig[name][blocks].view(np.uint16))
        # Unused prefetched objects that leave DRAM count as wasted.
        m.invalidate(engine_id=e.engine_id, chunks=[ch[4].key, ch[5].key])
        st = m.stats()
        assert st.prefetch_wasted == 2 * 2 * L
        assert_reservations_zero(m)


def test_a_prefetch_that_lands_across_an_invalidation_is_not_kept(tier, engine):
    """A prefetched segment whose invalidation ran while it was being admitted (after the epoch check, before
    the publish): it leaves DRAM again, and only it; a prefetch requested before an invalidation that
    lands after it is not admitted at all."""
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=2), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(2)
        _on_ssd_only(m, e.engine_id, ch)
        ns = m._engines[e.engine_id].ns
        keys = [ObjectKey(ns, c.key, s.layer, s.role) for c in ch for s in m._engines[e.engine_id].segs]
        blobs = tier.read_many(keys)
        admit = m._admit

        def racing(*a, **k):  # an invalidation of other chunks runs meanwhile
            m._inval_epoch += 1
            return admit(*a, **k)

        m._admit = racing
        m._prefetched(keys[0], blobs[0], m._inval_epoch)
        m._admit = admit
        assert not m.dram.contains(keys[0].pack())
        m._prefetched(keys[1], blobs[1], m._inval_epoch)  # no invalidation since: kept
        assert m.dram.contains(keys[1].pack())
        m._prefetched(keys[2], blobs[2], m._inval_epoch - 1)  # requested before one: dropped at once
        assert not m.dram.contains(keys[2].pack()) and m.stats().resident_objects["dram"] == 1
        assert_reservations_zero(m)


def test_lookup_hit_on_ssd_reads_the_next_chunks(tier, engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=1), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(4)
        _on_ssd_only(m, e.engine_id, ch)
        lk = m.lookup(e.engine_id, [ch[0].key], lease=False)
        assert (lk.count, lk.lower) == (1, 1)
        assert wait_until(lambda: m.stats().prefetch_segments == 2 * L)  # chunk 1 only (one chunk ahead)
        assert m.stats().lower["ssd_prefetch_requested_total"] == 2 * L
        assert m.lookup(e.engine_id, [ch[1].key], lease=False).dram == 1
        assert m.lookup(e.engine_id, [ch[2].key], lease=False).dram == 0


def test_prefetch_off_and_bounded_by_bytes(tier, engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=0), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(3)
        _on_ssd_only(m, e.engine_id, ch)
        assert all(m.restore(e.engine_id, ch[:1]).restored)
        time.sleep(0.2)
        assert m.stats().prefetch_segments == 0 and m.stats().lower["ssd_prefetch_requested_total"] == 0
    one = 8 << 10  # less than one record of this engine: nothing fits the byte bound
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=2, ssd_prefetch_bytes=one),
                 lower_tier=SsdTier(tier.config)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(3, salt="b")
        _on_ssd_only(m, e.engine_id, ch)
        assert all(m.restore(e.engine_id, ch[:1]).restored)
        time.sleep(0.2)
        st = m.stats()
        assert st.prefetch_segments == 0 and st.lower["ssd_prefetch_dropped_total"] > 0


def test_a_corrupt_prefetched_record_is_a_miss_later(tier, ssd_dir, engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=1), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(2)
        _on_ssd_only(m, e.engine_id, ch)
        victim = next(o for o in tier.iter_records() if o.key.chunk == ch[1].key)
        flip(str(ssd_dir / "shard0.okv"), victim.offset + RECORD_HEADER_SIZE + 200)
        assert all(m.restore(e.engine_id, ch[:1]).restored)
        assert wait_until(lambda: m.stats().prefetch_segments == 2 * L - 1)  # all of chunk 1 but the bad one
        time.sleep(0.1)
        assert m.stats().prefetch_segments == 2 * L - 1
        assert tier.snapshot().corrupt_records_total == 1
        misses = m.stats().misses
        res = m.restore(e.engine_id, ch[1:2])
        assert res.restored == [False]
        assert m.stats().misses == misses + 1


def test_cli_flags_and_metrics(tier, engine):
    from prometheus_client import CollectorRegistry, generate_latest

    from orbitkv_fs.server.cli import build_parser, config_from_args
    from orbitkv_fs.server.metrics import ManagerCollector

    p = build_parser()
    cfg = config_from_args(p.parse_args(["--ssd-prefetch-chunks", "5", "--ssd-prefetch-bytes", "4mb"]))
    assert (cfg.ssd_prefetch_chunks, cfg.ssd_prefetch_bytes) == (5, 4 << 20)
    assert config_from_args(p.parse_args([])).ssd_prefetch_chunks == 2
    assert config_from_args(p.parse_args(["--batch-segments", "128"])).batch_segments == 128
    assert config_from_args(p.parse_args([])).batch_segments == ManagerConfig().batch_segments
    with pytest.raises(SystemExit):
        p.parse_args(["--batch-segments", "0"])
    with pytest.raises(ValueError, match="batch_segments"):
        Manager(ManagerConfig(pool_size=1 << 20, batch_segments=0))
    with pytest.raises(ValueError, match="prefetch"):
        Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=-1))
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=1 << 20, ssd_prefetch_chunks=1), lower_tier=tier) as m:
        e = m.register_engine(reg)
        ch = chunks_for(2)
        _on_ssd_only(m, e.engine_id, ch)
        assert all(m.restore(e.engine_id, ch[:1]).restored)
        assert wait_until(lambda: m.stats().prefetch_segments == 2 * L)
        m.restore(e.engine_id, ch[1:2])
        reg_ = CollectorRegistry()
        reg_.register(ManagerCollector(m))
        text = generate_latest(reg_).decode()
        assert f"orbitkv_prefetch_segments_total {float(2 * L)}" in text
        assert f"orbitkv_prefetch_hits_total {float(2 * L)}" in text
        assert "orbitkv_prefetch_wasted_total 0.0" in text and "orbitkv_prefetch_bytes_total" in text
        assert "orbitkv_ssd_prefetch_read_total" in text
