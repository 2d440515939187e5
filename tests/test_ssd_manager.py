"""The SSD tier under a real Manager: demotion, promotion, corruption as a miss, restart with recovery,
and the ``orbitkv-cache-manager`` SSD flags."""

from __future__ import annotations

import numpy as np
import pytest

from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.server.cli import build_lower_tier, build_parser
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE
from test_manager import chunks_for, make_engine, snapshot, zero
from test_ssd_common import direct_io_dir, flip


@pytest.fixture
def ssd_paths(tmp_path):
    d = direct_io_dir(tmp_path)
    return (str(d / "m0.okv"), str(d / "m1.okv"))


def tier(paths, recover=False) -> SsdTier:
    return SsdTier(SsdConfig(paths=paths, capacity=64 << 20, recover=recover))


def test_demote_promote_corrupt_restart(ssd_paths):
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        chunks = chunks_for(8)
        keys = [c.key for c in chunks]
        with Manager(ManagerConfig(pool_size=512 << 10), lower_tier=tier(ssd_paths)) as m:
            e = m.register_engine(reg)
            m.save(e.engine_id, chunks)
            m.flush_dram()  # every object now lives on the SSD only
            st = m.stats()
            assert st.lower["ssd_objects"] == 8 * 6 * 2 and st.lower["ssd_write_errors_total"] == 0
            zero(pages)
            lk = m.lookup(e.engine_id, keys[:4])
            assert lk.count == 4 and lk.lower == 4
            res = m.restore(e.engine_id, chunks[:4], lease_id=lk.lease_id)
            assert res.restored == [True] * 4
            for name in pages.tensors:
                blocks = [b for c in chunks[:4] for b in c.blocks]
                assert np.array_equal(pages.array(name)[blocks].view(np.uint16), orig[name][blocks].view(np.uint16))
            # Damage one segment of chunk 6 on disk: that chunk misses, chunk 7 is intact.
            victim = next(o for o in m.lower.iter_records() if o.key.chunk == keys[6])
            flip(ssd_paths[victim.shard], victim.offset + RECORD_HEADER_SIZE + 200)
            assert m.lookup(e.engine_id, keys[6:7], lease=False).count == 0
            assert m.lower.snapshot().corrupt_records_total == 1
            assert m.lookup(e.engine_id, keys[7:8], lease=False).count == 1
            m.flush_dram()
        # A restarted Manager with --ssd-recover serves the old SSD data (minus the corrupt record).
        with Manager(ManagerConfig(pool_size=512 << 10), lower_tier=tier(ssd_paths, recover=True)) as m:
            e = m.register_engine(reg)
            assert m.lower.snapshot().recovered_records >= 8 * 6 * 2 - 1
            zero(pages)
            lk = m.lookup(e.engine_id, keys[4:6])
            assert lk.count == 2
            assert m.restore(e.engine_id, chunks[4:6], lease_id=lk.lease_id).restored == [True, True]
            blocks = [b for c in chunks[4:6] for b in c.blocks]
            for name in pages.tensors:
                assert np.array_equal(pages.array(name)[blocks].view(np.uint16), orig[name][blocks].view(np.uint16))
            assert m.lookup(e.engine_id, keys[6:7], lease=False).count == 0
    finally:
        pages.close()


def test_cli_flags(ssd_paths):
    p = build_parser()
    assert build_lower_tier(p.parse_args([])) is None
    args = p.parse_args(["--ssd-cache-path", ssd_paths[0], "--ssd-cache-path", ssd_paths[1],
                         "--ssd-cache-capacity", "64mb", "--ssd-backend", "uring", "--ssd-write-queue-depth", "8"])
    t = build_lower_tier(args)
    try:
        s = t.snapshot()
        assert (s.shards, s.capacity_bytes, t.config.write_queue_depth, t.config.recover) == (2, 64 << 20, 8, False)
        assert t.config.read_timeout == 2.0  # below the vLLM connector's 5 s lookup timeout
    finally:
        t.close()
    t = build_lower_tier(p.parse_args(["--ssd-cache-path", ssd_paths[0], "--ssd-cache-capacity", "64mb",
                                       "--ssd-read-timeout", "0.5"]))
    try:
        assert t.config.read_timeout == 0.5
    finally:
        t.close()
    with pytest.raises(ValueError, match="--ssd-read-timeout"):
        build_lower_tier(p.parse_args(["--ssd-cache-path", ssd_paths[0], "--ssd-cache-capacity", "64mb",
                                       "--ssd-read-timeout", "0"]))
    with pytest.raises(ValueError, match="capacity"):
        build_lower_tier(p.parse_args(["--ssd-cache-path", ssd_paths[0]]))
    args = p.parse_args(["--ssd-cache-path", ssd_paths[0], "--ssd-cache-capacity", "64mb", "--ssd-recover"])
    t = build_lower_tier(args)
    assert t.config.recover
    t.close()


def test_manager_keeps_serving_through_ssd_write_errors_and_a_slow_lane(ssd_paths):
    import errno

    from orbitkv_fs.tiers.ssd.faults import FaultyBackend, Faults
    from orbitkv_fs.tiers.ssd.uring import UringBackend

    faults = Faults(write_errno=errno.EIO, write_errors=10, write_delay=0.05)
    lower = SsdTier(SsdConfig(paths=ssd_paths, capacity=64 << 20), backend=FaultyBackend(UringBackend(), faults))
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        chunks = chunks_for(8)
        keys = [c.key for c in chunks]
        with Manager(ManagerConfig(pool_size=512 << 10), lower_tier=lower) as m:
            e = m.register_engine(reg)
            m.save(e.engine_id, chunks)
            m.flush_dram()
            st = m.stats()
            assert st.lower["ssd_write_errors_total"] == 10 and st.lower["ssd_io_errors_eio_total"] == 10
            assert st.lower["ssd_objects"] == 8 * 6 * 2 - 10
            # Chunks whose segments all reached the SSD restore exactly; the others are plain misses.
            zero(pages)
            complete = [i for i in range(8) if m.lookup(e.engine_id, keys[i:i + 1], lease=False).count == 1]
            assert 0 < len(complete) < 8
            for i in complete:
                lk = m.lookup(e.engine_id, keys[i:i + 1])
                assert m.restore(e.engine_id, chunks[i:i + 1], lease_id=lk.lease_id).restored == [True]
                for name in pages.tensors:
                    b = chunks[i].blocks
                    assert np.array_equal(pages.array(name)[b].view(np.uint16), orig[name][b].view(np.uint16))
            # The Manager goes on saving and serving: the failed chunks are saved again and come back.
            failed = [chunks[i] for i in range(8) if i not in complete]
            m.save(e.engine_id, failed)
            lk = m.lookup(e.engine_id, [c.key for c in failed])
            assert lk.count == len(failed)
            m.release(lk.lease_id)
    finally:
        pages.close()


def test_cache_manager_process_with_ssd_flags(ssd_paths, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    base = [sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mib", "--device", "cpu",
            "--shm-dir", str(tmp_path), "--data-plane", f"ipc://{tmp_path}/dp.sock"]
    bad = subprocess.run(base + ["--ssd-cache-path", str(tmp_path / "no" / "such" / "dir.okv"),
                                 "--ssd-cache-capacity", "64mb"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot open" in bad.stderr and "Traceback" not in bad.stderr
    p = subprocess.Popen(base + ["--ssd-cache-path", ssd_paths[0], "--ssd-cache-path", ssd_paths[1],
                                 "--ssd-cache-capacity", "64mb", "--ssd-write-queue-depth", "8"],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        log = ""
        while "ready" not in log and time.monotonic() < deadline and p.poll() is None:
            log += p.stderr.readline()
        assert "ready" in log, log
        assert [os.path.getsize(x) for x in ssd_paths] == [32 << 20, 32 << 20]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
        p.wait()


def test_objects_stay_visible_while_their_demotion_is_in_flight(ssd_paths):
    """An object evicted from DRAM is served from the bytes handed to the SSD tier until its write lands
    (the writes are held back here, so every lookup runs inside that window)."""
    from orbitkv_fs.tiers.ssd.faults import FaultyBackend, Faults
    from orbitkv_fs.tiers.ssd.uring import UringBackend

    faults = Faults(write_delay=1.5)
    lower = SsdTier(SsdConfig(paths=ssd_paths, capacity=64 << 20), backend=FaultyBackend(UringBackend(), faults))
    pages, reg = make_engine()
    try:
        orig = snapshot(pages)
        chunks = chunks_for(12)
        keys = [c.key for c in chunks]
        with Manager(ManagerConfig(pool_size=512 << 10), lower_tier=lower) as m:
            e = m.register_engine(reg)
            m.save(e.engine_id, chunks)
            assert m.stats().demoted > 0
            snap = lower.snapshot()
            assert snap.objects == 0 and snap.writing_bytes > 0  # nothing committed yet
            zero(pages)
            lk = m.lookup(e.engine_id, keys[:4])
            assert lk.count == 4 and lk.lower > 0
            assert m.restore(e.engine_id, chunks[:4], lease_id=lk.lease_id).restored == [True] * 4
            blocks = [b for c in chunks[:4] for b in c.blocks]
            for name in pages.tensors:
                assert np.array_equal(pages.array(name)[blocks].view(np.uint16), orig[name][blocks].view(np.uint16))
            assert lower.snapshot().read_pending_hits_total > 0
            # Invalidation hides a pending object at once, even though its write completes later.
            gone = keys[0]
            m.invalidate(engine_id=e.engine_id, chunks=[gone])
            assert m.lookup(e.engine_id, [gone], lease=False).count == 0
            faults.write_delay = 0.0
            lower.flush()
            assert m.lookup(e.engine_id, [gone], lease=False).count == 0
            assert m.lookup(e.engine_id, keys[1:4], lease=False).count == 3
    finally:
        pages.close()


def test_a_lower_tier_without_submit_many_gets_a_copy_of_each_victim():
    """DRAM's eviction hands the lower tier views of extents it reuses at once: a tier with only ``submit``
    (the protocol's required method) gets each victim as ``bytes``, unchanged when the extents are reused."""
    from orbitkv_fs.manager.lower import demoter
    from test_ssd_common import key, segment

    got: list = []

    class OnlySubmit:
        def submit(self, k, seg, *, timeout=0.0):
            got.append((k, seg))
            return k != key(2)  # dropped: not counted

    segs = [segment(i) for i in range(4)]
    arena = bytearray(b"".join(segs))
    views = [memoryview(arena)[i * len(segs[0]):(i + 1) * len(segs[0])] for i in range(4)]
    assert demoter(OnlySubmit())([key(i) for i in range(4)], views) == 3
    arena[:] = bytes(len(arena))
    assert got == [(key(i), segs[i]) for i in range(4)] and all(type(s) is bytes for _, s in got)
    tier = SsdTier.__new__(SsdTier)
    assert demoter(tier) == tier.submit_many  # the SSD tier takes the batch itself
