"""The SSD tier on a disk that really fails: a FUSE file system (tests/faultyfs.py) under the shard files, so
every fault comes from the kernel as a failing drive's would, through io_uring, ``pread`` and page faults:
unreadable blocks (EIO), bit rot, failing writes, and a disk that stops answering. Each time the tier and the
Manager above it keep serving what is sound, never serve wrong bytes, never hang a caller for longer than
the configured deadline, and never die.

Skipped where no FUSE file system can be mounted (no /dev/fuse, no ``fusermount3``/root, or mfusepy missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from polling import wait_until
from test_ssd_common import key, segment

HERE = Path(__file__).parent
ROOT = HERE.parent
N = 40


class FaultyDisk:
    """A mounted tests/faultyfs.py: ``path`` is its mount point, :meth:`set` its faults."""

    def __init__(self, base: Path) -> None:
        self.backing, self.path, self.control = base / "backing", base / "disk", base / "faults.json"
        self.backing.mkdir()
        self.path.mkdir()
        self.set()
        self.log = open(base / "faultyfs.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "faultyfs.py"), str(self.backing), str(self.path),
                                      str(self.control)], stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_until(lambda: os.path.ismount(self.path) or self.proc.poll() is not None, 15):
            self.close()
            pytest.skip("faultyfs did not mount in 15 s")
        if not os.path.ismount(self.path):
            self.close()
            pytest.skip(f"cannot mount a FUSE file system here: {(base / 'faultyfs.log').read_text()[-300:]}")

    def set(self, **faults: object) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, self.control)
        time.sleep(0.02)  # the file system reads the rules by their mtime

    def reads(self) -> int:
        try:
            return json.loads(Path(str(self.control) + ".seen").read_text())["reads"]
        except (FileNotFoundError, ValueError):
            return 0

    def close(self) -> None:
        self.set()  # whatever hangs answers: the kernel's requests end before the unmount
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture
def disk(tmp_path):
    pytest.importorskip("mfusepy")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    d = FaultyDisk(tmp_path)
    try:
        yield d
    finally:
        d.close()


def _bounded(disk: FaultyDisk, seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, which must return within ``seconds``; one that does not fails the test, after
    the disk is made to answer (so that it, and the test, end)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(seconds)
    if th.is_alive():
        disk.set()
        th.join(60)
        raise AssertionError(f"{getattr(fn, '__name__', fn)} waited on a disk that does not answer "
                             f"(over {seconds} s; {time.monotonic() - t0:.1f} s once the disk answered)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _filled(disk: FaultyDisk, **config) -> tuple[SsdTier, list]:
    t = SsdTier(SsdConfig(paths=(str(disk.path / "a.okv"),), capacity=32 << 20, **config))
    for i in range(N):
        assert t.submit(key(i), segment(i))
    t.flush()
    t.checkpoint()
    return t, sorted(t.iter_records(), key=lambda o: o.offset)


def _number(k) -> int:
    """Which of the ``N`` keys ``k`` is."""
    return next(i for i in range(N) if key(i) == k)


def _others_served(t: SsdTier, but: int) -> bool:
    others = [j for j in range(N) if j != but]
    return t.read_many([key(j) for j in others]) == [segment(j) for j in others]


def _recover_in_child(shard: str) -> subprocess.CompletedProcess:
    """``SsdTier(recover=True)`` over ``shard`` in a child process (a page fault on an unreadable block
    kills its process with SIGBUS: the test process must survive to report it), reading back every key."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
        from test_ssd_common import key, segment
        t = SsdTier(SsdConfig(paths=({shard!r},), capacity=32 << 20, recover=True))
        got = [t.read(key(i)) for i in range({N})]
        s = t.snapshot()
        print(json.dumps({{"served": [i for i, g in enumerate(got) if g == segment(i)],
                          "wrong": [i for i, g in enumerate(got) if g is not None and g != segment(i)],
                          "unreadable": s.recovered_unreadable_bytes_total,
                          "chain_breaks": s.recovered_chain_breaks_total}}))
        t.close()
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})


def test_recovery_over_an_unreadable_block_recovers_the_rest_instead_of_dying(disk):
    """A shard with one block the disk cannot read: before, recovery mapped the shard and its scan faulted
    on the block (SIGBUS: the Manager died at every start with --ssd-recover). Now the block reads as zeros
    (damage), the records newer than it are recovered, nothing wrong is served."""
    t, recs = _filled(disk)
    t.close()
    bad = recs[N // 2]
    disk.set(read_eio=[["a.okv", bad.offset, 4096]])
    r = _recover_in_child(str(disk.path / "a.okv"))
    assert r.returncode == 0, f"recovery died (rc {r.returncode}): {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["wrong"] == [] and out["unreadable"] == 4096
    # The checkpoint called the damaged record durable: the chain ends there, the newer records are served.
    offset = {o.key: o.offset for o in recs}
    newer = [i for i in range(N) if offset[key(i)] > bad.offset]
    assert out["served"] == newer and out["chain_breaks"] == 1
    assert "could not be read" in r.stderr


def test_inspect_reports_unreadable_blocks_and_exits_1(disk):
    t, recs = _filled(disk)
    t.close()
    disk.set(read_eio=[["a.okv", recs[3].offset, 4096]])
    r = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.inspect", "verify", str(disk.path / "a.okv")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1, (r.returncode, r.stderr[-1000:])
    assert f"unreadable: 4096 bytes at offset {recs[3].offset}" in r.stdout
    s = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.inspect", "summary", "--json",
                        str(disk.path / "a.okv")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert s.returncode == 0 and json.loads(s.stdout)["unreadable"] == [[recs[3].offset, 4096]]


def test_eio_from_the_disk_misses_only_its_record_which_is_served_once_it_reads_or_dropped_if_it_never_does(disk):
    t, recs = _filled(disk)
    try:
        victim = recs[7]
        i = _number(victim.key)
        disk.set(read_eio=[["a.okv", victim.offset + 4096, 1]])  # inside the record, past its header
        before = disk.reads()
        got = t.read_many([o.key for o in recs])
        assert disk.reads() > before  # the reads went through the failing disk
        want = [segment(_number(o.key)) for o in recs]
        assert all(g is None or g == w for g, w in zip(got, want))  # nothing served is wrong
        # Only the victim misses: its neighbours, read by the same failed request, were read again alone.
        assert [k for k, g in enumerate(got) if g is None] == [7]
        s = t.snapshot()
        assert s.errors_by_errno == {"EIO": 1} and s.corrupt_records_total == 0
        assert t.contains(victim.key)  # one I/O error invalidates nothing
        disk.set()  # the block reads again (a transient error): served, and its failure forgotten
        assert t.read(victim.key) == segment(i)
        disk.set(read_eio=[["a.okv", victim.offset + 4096, 1]])
        assert t.read(victim.key) is None and t.contains(victim.key)
        # A block that fails again: the record is dropped, not tried at every read (a drive may spend
        # seconds on each try of a bad sector).
        assert t.read(victim.key) is None and not t.contains(victim.key)
        s = t.snapshot()
        assert s.unreadable_records_dropped_total == 1 and s.errors_by_errno == {"EIO": 3}
        disk.set()
        assert _others_served(t, but=i)
    finally:
        t.close()


def test_bit_rot_under_the_tier_is_a_miss_never_wrong_bytes(disk):
    t, recs = _filled(disk)
    try:
        victim = recs[11]
        disk.set(corrupt=[["a.okv", victim.offset + 5000]])
        assert t.read(victim.key) is None
        assert t.snapshot().corrupt_records_total == 1 and not t.contains(victim.key)
        assert _others_served(t, but=_number(victim.key))
    finally:
        t.close()


def test_failing_writes_publish_nothing_and_the_tier_keeps_serving(disk):
    t, recs = _filled(disk)
    try:
        disk.set(write_errno="EIO")
        for j in range(100, 106):
            assert t.submit(key(j), segment(j))
        t.flush()
        s = t.snapshot()
        assert s.write_errors_total == 6 and s.errors_by_errno.get("EIO") == 6
        assert not any(t.contains(key(j)) for j in range(100, 106))
        assert t.read_many([key(j) for j in range(N)]) == [segment(j) for j in range(N)]
        disk.set()
        assert t.submit(key(100), segment(100))
        t.flush()
        assert t.read(key(100)) == segment(100)
    finally:
        t.close()


def test_a_disk_that_stops_answering_reads_costs_one_deadline_then_its_reads_miss_at_once(disk):
    t, recs = _filled(disk, read_timeout=1.0)
    try:
        disk.set(hang_reads=True)
        t0 = time.monotonic()
        assert _bounded(disk, 5.0, t.read, key(1)) is None
        assert time.monotonic() - t0 >= 0.9
        s = t.snapshot()
        assert s.stalled_shards == 1 and s.errors_by_errno.get("timeout") == 1
        assert _bounded(disk, 0.5, t.read_many, [key(2), key(3)]) == [None, None]
        assert t.snapshot().read_stalled_total == 2
        assert t.contains(key(1)) and t.contains(key(2))  # a stall invalidates nothing
        # Writes go on (this disk hangs reads only).
        assert t.submit(key(200), segment(200))
        t.flush(timeout=10)
        disk.set()  # the disk answers again: the read given up on completes, the shard is read again
        assert wait_until(lambda: t.read(key(4)) == segment(4), 10)
        assert t.snapshot().stalled_shards == 0
        assert t.read_many([key(j) for j in range(N)]) == [segment(j) for j in range(N)]
        assert t.read(key(200)) == segment(200)
        # A record whose reads time out twice in a row: a timeout is the disk's, not the record's, and
        # drops nothing (two I/O errors in a row would).
        for _ in range(2):
            disk.set(hang_reads=True)
            assert _bounded(disk, 5.0, t.read, key(5)) is None
            disk.set()
            assert wait_until(lambda: t.read(key(6)) == segment(6), 10)  # the shard is read again
        assert t.read(key(5)) == segment(5)
        assert t.snapshot().unreadable_records_dropped_total == 0
    finally:
        t.close()


def test_a_manager_over_a_hung_disk_answers_lookups_restores_flushes_and_closes_in_bounded_time(disk):
    """A disk that stops answering at all (reads, writes, syncs) under a Manager: a lookup of SSD-resident
    chunks costs at most the read deadline once and then answers at once, a restore misses instead of
    waiting, a DRAM flush returns ``complete=False`` at its deadline, and close returns. After the disk
    answers again, the close finishes and a restarted Manager recovers what was checkpointed."""
    from orbitkv_fs.manager import Manager, ManagerConfig
    from test_manager import chunks_for, make_engine

    pages, reg = make_engine()
    shard = str(disk.path / "m.okv")
    try:
        chunks = chunks_for(8)
        keys = [c.key for c in chunks]
        m = Manager(ManagerConfig(pool_size=512 << 10),
                    lower_tier=SsdTier(SsdConfig(paths=(shard,), capacity=64 << 20, read_timeout=1.0,
                                                 close_timeout=2.0)))
        e = m.register_engine(reg)
        m.save(e.engine_id, chunks[:4] + chunks[6:7])
        assert m.flush_dram().complete
        m.lower.checkpoint()
        # Chunk 6 through every path once while the disk answers, so that no first-call cost (numba's
        # compile on a cold cache) lands inside the bounds below.
        lk = m.lookup(e.engine_id, keys[6:7])
        assert lk.count == 1 and m.restore(e.engine_id, chunks[6:7], lease_id=lk.lease_id).restored == [True]
        assert m.restore(e.engine_id, chunks[6:7]).restored == [True]
        disk.set(hang=True)
        assert _bounded(disk, 3.0, m.lookup, e.engine_id, keys[:4]).count == 0
        assert _bounded(disk, 0.5, m.lookup, e.engine_id, keys[:4], lease=False).count == 0
        assert _bounded(disk, 0.5, m.restore, e.engine_id, chunks[:2]).restored == [False, False]
        _bounded(disk, 0.5, m.save, e.engine_id, chunks[4:])  # saves go to DRAM as ever
        assert not _bounded(disk, 4.0, m.flush_dram, timeout=2.0).complete
        _bounded(disk, 4.0, m.close)
        disk.set()
        assert m.lower.wait_closed(30)  # once the disk answers, the close ends (and lets go of the shard)
        with Manager(ManagerConfig(pool_size=512 << 10),
                     lower_tier=SsdTier(SsdConfig(paths=(shard,), capacity=64 << 20, recover=True))) as m2:
            e2 = m2.register_engine(reg)
            assert m2.lookup(e2.engine_id, keys[:4], lease=False).count == 4
    finally:
        disk.set()
        pages.close()


def test_closing_over_a_disk_whose_syncs_hang_returns_at_its_deadline_and_ends_once_it_answers(disk):
    """Nothing queued, nothing in flight: only the final checkpoint's sync meets the hung disk."""
    t, _ = _filled(disk, close_timeout=1.0)
    disk.set(hang=True)
    t0 = time.monotonic()
    _bounded(disk, 3.0, t.close)
    assert time.monotonic() - t0 >= 0.9 and not t.wait_closed(0)
    disk.set()
    assert t.wait_closed(30)
    again = SsdTier(SsdConfig(paths=(str(disk.path / "a.okv"),), capacity=32 << 20, recover=True))
    try:  # the shard's lock was let go, and the checkpoint the close finished covers every record
        assert again.read_many([key(i) for i in range(N)]) == [segment(i) for i in range(N)]
    finally:
        again.close()


def test_a_manager_whose_disk_hangs_at_its_start_serves_dram_after_its_start_timeout(disk, tmp_path):
    """``orbitkv-cache-manager --ssd-recover`` over a shard whose disk stops answering reads: before, its
    recovery waited in ``pread`` for as long as the disk did, the Manager never became ready (DRAM included)
    and SIGTERM did not stop it. Now its start is given up after ``--ssd-start-timeout`` without progress: it
    serves with DRAM only, says so in its log, in /readyz and in /metrics (for an alert), and the tier its start
    finishes once the disk answers is closed, not served."""
    import urllib.request

    from manager_process import ManagerProcess, sample_engine_round_trip

    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ("--ssd-cache-path", str(disk.path / "a.okv"), "--ssd-cache-capacity", "64mb")
    first = ManagerProcess(*flags, shm_dir=str(shm), pool="64mb")
    try:
        sample_engine_round_trip(first.endpoint, str(shm))  # a cache on the disk to recover
        with urllib.request.urlopen(first.http + "/readyz", timeout=5) as r:
            assert json.loads(r.read())["lower_tier_missing"] is None
        with urllib.request.urlopen(first.http + "/metrics", timeout=5) as r:
            assert 'orbitkv_lower_tier_missing{tier="ssd"} 0.0' in r.read().decode()
    finally:
        assert first.stop() == 0
    disk.set(hang_reads=True)
    t0 = time.monotonic()
    m = ManagerProcess(*flags, "--ssd-recover", "--ssd-start-timeout", "2", shm_dir=str(shm), pool="64mb",
                       timeout=30)
    try:
        assert time.monotonic() - t0 < 25, m.log  # the start timeout, not the disk, decided
        assert "made no progress for 2 s" in m.log and "starts with DRAM only" in m.log
        with urllib.request.urlopen(m.http + "/readyz", timeout=5) as r:
            ready = json.loads(r.read())
            assert (ready["lower_tier"], ready["lower_tier_missing"]) == (None, "ssd")
        with urllib.request.urlopen(m.http + "/metrics", timeout=5) as r:
            assert 'orbitkv_lower_tier_missing{tier="ssd"} 1.0' in r.read().decode()
        sample_engine_round_trip(m.endpoint, str(shm))  # DRAM serves
        disk.set()
        assert wait_until(lambda: "finished after it was given up: closed" in m.log, 30), m.log
    finally:
        disk.set()
        assert m.stop() == 0


def test_a_start_that_is_busy_is_waited_for_and_one_held_by_the_kernel_is_given_up(monkeypatch, caplog):
    """open_tier's watch, with the tier's constructor replaced (the real disk is the test above): a start that
    reports nothing but keeps its thread busy (adopting a large index) is waited for past the stall time; one
    whose thread sits still (a read the kernel holds) is given up, and the tier it makes later is closed, or
    its later failure logged."""
    from orbitkv_fs.tiers.ssd import start

    made: list = []

    class Busy:
        def __init__(self, config, on_progress=None) -> None:
            end = time.thread_time() + 1.5
            while time.thread_time() < end:
                pass
            made.append(self)

    class Held:
        closed = threading.Event()

        def __init__(self, config, on_progress=None) -> None:
            time.sleep(2.5)

        def close(self) -> None:
            Held.closed.set()

    config = SsdConfig(paths=("/nonexistent/a.okv",), capacity=32 << 20)
    monkeypatch.setattr(start, "SsdTier", Busy)
    assert start.open_tier(config, stall=0.6) is made[0]
    monkeypatch.setattr(start, "SsdTier", Held)
    t0 = time.monotonic()
    with pytest.raises(start.SsdStartStalled, match="made no progress for 1 s"):
        start.open_tier(config, stall=1.0)
    assert time.monotonic() - t0 < 2.4  # given up before the start could finish
    assert Held.closed.wait(10)  # and what it made afterwards was closed

    class HeldThenFails:
        def __init__(self, config, on_progress=None) -> None:
            time.sleep(2.5)
            raise start.SsdIoError("the disk answered EIO")

    monkeypatch.setattr(start, "SsdTier", HeldThenFails)
    with caplog.at_level("WARNING", logger="orbitkv_fs.tiers.ssd.start"):
        with pytest.raises(start.SsdStartStalled):
            start.open_tier(config, stall=1.0)
        assert wait_until(lambda: "failed once the disk answered: the disk answered EIO" in caplog.text, 10)
