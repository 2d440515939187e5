"""Restart of the SSD tier: ephemeral by default; with ``recover`` the rings are scanned, every record
validated, the chain of each shard's log walked, the newest valid generation per key served again, torn
and corrupt records counted. Includes a torn record at the ring head, damage to a payload and to a header,
a truncated file, and a real ``kill -9`` during writeback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orbitkv_fs.tiers.ssd import SsdConfig, SsdIoError, SsdTier
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE, record_length
from test_ssd_common import direct_io_dir, flip, key, pwrite, read_header, record_image, segment

N = 30


@pytest.fixture
def paths(tmp_path):
    d = direct_io_dir(tmp_path)
    return (str(d / "a.okv"), str(d / "b.okv"))


def fill(paths, n=N, **kw) -> SsdTier:
    t = SsdTier(SsdConfig(paths=paths, capacity=32 << 20, **kw))
    for i in range(n):
        assert t.submit(key(i), segment(i))
    t.flush()
    return t


def reopen(paths) -> SsdTier:
    return SsdTier(SsdConfig(paths=paths, capacity=32 << 20, recover=True))


def test_default_restart_is_ephemeral(paths):
    fill(paths).close()
    with SsdTier(SsdConfig(paths=paths, capacity=32 << 20)) as t:
        assert t.snapshot().objects == 0 and not t.contains(key(0))
    with reopen(paths) as t:  # the truncation really removed the records
        assert t.snapshot().objects == 0


def test_recover_serves_newest_generation(paths):
    t = fill(paths)
    t.submit(key(0), segment(0, version=7))
    t.flush()
    t.invalidate(keys=[key(1)])
    t.close()
    with reopen(paths) as t:
        s = t.snapshot()
        assert s.objects == N - 1 and s.recovered_records == N - 1
        assert s.recovered_torn_total == 0 and s.recovered_corrupt_total == 0
        assert t.read(key(0)) == segment(0, version=7)
        assert t.read(key(1)) is None  # invalidated stays invalidated
        assert t.read_many([key(i) for i in range(2, N)]) == [segment(i) for i in range(2, N)]
        # New writes continue after the recovered ones without clobbering them.
        for i in range(N, N + 10):
            t.submit(key(i), segment(i))
        t.flush()
        assert t.read_many([key(i) for i in range(2, N + 10)]) == [segment(i) for i in range(2, N + 10)]


def test_torn_record_at_ring_head(paths):
    t = fill(paths)
    newest = max(t.iter_records(), key=lambda o: o.generation)
    path, head = paths[newest.shard], newest.offset + record_length(newest.stored_bytes)
    t.close()
    seg = segment(999)
    # The next record of the log (it links to the newest): its header and the first part of its segment
    # reached the disk, the rest did not.
    prev = (newest.offset, read_header(path, newest.offset).tag)
    pwrite(path, head, record_image(path, head, key(999), newest.generation + 1, seg, prev)[:RECORD_HEADER_SIZE + 4000])
    with reopen(paths) as t:
        s = t.snapshot()
        assert s.recovered_torn_total == 1 and s.recovered_corrupt_total == 0 and s.objects == N
        assert s.recovered_chain_breaks_total == 0
        assert not t.contains(key(999))
        assert t.read_many([key(i) for i in range(N)]) == [segment(i) for i in range(N)]


def one_shard(paths, n=N) -> tuple[str, dict]:
    """A single-shard tier holding ``n`` records (closed cleanly); its path and records by key."""
    t = SsdTier(SsdConfig(paths=paths[:1], capacity=32 << 20))
    for i in range(n):
        assert t.submit(key(i), segment(i))
    t.flush()
    recs = {o.key: o for o in t.iter_records()}
    t.close()
    return paths[0], recs


def reopen_one(paths) -> SsdTier:
    return SsdTier(SsdConfig(paths=paths[:1], capacity=32 << 20, recover=True))


def test_damaged_payload_is_counted_and_only_that_key_misses(paths):
    path, recs = one_shard(paths)
    flip(path, recs[key(3)].offset + RECORD_HEADER_SIZE + 64 + 77)
    with reopen_one(paths) as t:
        s = t.snapshot()
        assert (s.recovered_corrupt_total, s.recovered_torn_total, s.recovered_chain_breaks_total) == (1, 0, 0)
        assert s.objects == N - 1 and t.read(key(3)) is None
        rest = [i for i in range(N) if i != 3]
        assert t.read_many([key(i) for i in rest]) == [segment(i) for i in rest]


@pytest.mark.parametrize("where", [9, 50, 70, 90, 120])  # key, generation, own offset, link, tag
def test_damaged_header_of_a_durable_record_ends_what_is_adopted(paths, where):
    """A record the checkpoint says was durable whose header no longer verifies breaks the chain: the
    records newer than it are served, nothing older (it could have been a tombstone, or a newer version
    of an older record's key)."""
    path, recs = one_shard(paths)
    flip(path, recs[key(10)].offset + where)
    with reopen_one(paths) as t:
        s = t.snapshot()
        assert s.recovered_chain_breaks_total == 1 and s.objects == N - 11
        assert not any(t.contains(key(i)) for i in range(11))
        assert t.read_many([key(i) for i in range(11, N)]) == [segment(i) for i in range(11, N)]


def test_truncated_file_loses_durable_records_so_nothing_older_is_adopted(paths):
    """Cutting a shard file loses its newest records, which the checkpoint calls durable: that shard
    serves nothing (an older record could be shadowed by a lost newer one); the other shard is intact."""
    t = fill(paths)
    records = list(t.iter_records())
    t.close()
    cut = sorted(o.offset for o in records if o.shard == 0)[2] + 5000
    os.truncate(paths[0], cut)
    with reopen(paths) as t:
        s = t.snapshot()
        kept = [o for o in records if o.shard == 1]
        assert s.objects == len(kept) and s.recovered_chain_breaks_total == 1
        idx = {key(i): i for i in range(N)}
        assert t.read_many([o.key for o in kept]) == [segment(idx[o.key]) for o in kept]
        assert os.path.getsize(paths[0]) == t.snapshot().capacity_bytes // 2  # preallocated again
        # The shard goes on: new records, recovered again after the next restart.
        assert t.submit(key(500), segment(500)) and t.submit(key(501), segment(501))
        t.flush()
    with reopen(paths) as t:
        assert t.read_many([key(500), key(501)]) == [segment(500), segment(501)]
        assert t.snapshot().objects == len(kept) + 2


CHILD = textwrap.dedent("""
    import sys
    from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
    from test_ssd_common import key, segment
    t = SsdTier(SsdConfig(paths=tuple(sys.argv[1:]), capacity=512 << 20, write_queue_depth=16))
    i = 0
    while True:
        for _ in range(8):
            t.submit(key(i, layer=0), segment(i, n=65536))
            i += 1
        t.flush()
        print(i, flush=True)  # every key below i is published
""")


def test_kill_9_during_writeback_recovers_only_completed_records(paths):
    # Prepended, not replaced: an install that lives on PYTHONPATH (the GPU host's) must reach the child too.
    path = [str(Path(__file__).parent), str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    child = subprocess.Popen([sys.executable, "-c", CHILD, *paths], stdout=subprocess.PIPE, env=env, text=True)
    published = 0
    try:
        for line in child.stdout:
            published = int(line)
            if published >= 160:
                break
        # Let it queue more writes, then kill it mid-writeback.
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert published >= 160
    with reopen(paths) as t:
        s = t.snapshot()
        got = {o.key: o for o in t.iter_records()}
        # Everything published before the kill is back, byte for byte.
        assert all(key(i) in got for i in range(published))
        assert t.read_many([key(i) for i in range(published)]) == [segment(i, n=65536) for i in range(published)]
        # Whatever else came back is complete (validated, right bytes); the rest was torn or never written.
        extra = sorted(i for i in range(published, published + 10_000) if key(i) in got)
        assert t.read_many([key(i) for i in extra]) == [segment(i, n=65536) for i in extra]
        assert s.recovered_corrupt_total == 0


def test_shard_files_are_private_locked_and_trusted_only_when_private(paths):
    t = fill(paths)
    assert {o.shard for o in t.iter_records()} == {0, 1}
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths)
    with pytest.raises(SsdIoError, match="in use by another process"):
        SsdTier(SsdConfig(paths=paths, capacity=32 << 20, recover=True))
    t.close()
    os.chmod(paths[0], 0o644)  # someone else could have read its secret: nothing in it is trusted
    with reopen(paths) as t:
        s = t.snapshot()
        assert s.recovered_shards_refused_total == 1
        assert {o.shard for o in t.iter_records()} == {1}
        assert os.stat(paths[0]).st_mode & 0o777 == 0o600  # and private again
    with reopen(paths) as t:  # a fresh secret in shard 0: what it holds now is recovered again
        assert t.snapshot().recovered_shards_refused_total == 0


def test_a_shard_of_another_layout_or_format_starts_empty(paths, tmp_path):
    fill(paths, n=6).close()
    with SsdTier(SsdConfig(paths=paths[::-1], capacity=32 << 20, recover=True)) as t:  # shards swapped
        assert t.snapshot().objects == 0 and t.snapshot().recovered_shards_refused_total == 2
    old = str(direct_io_dir(tmp_path) / "v1.okv")
    with open(old, "wb") as f:  # a file of the format before version 2: records, no superblock
        f.write(b"OKVR\x01\x00\x80\x00" + bytes(4088))
    with SsdTier(SsdConfig(paths=(old,), capacity=8 << 20, recover=True)) as t:
        assert t.snapshot().objects == 0 and t.snapshot().recovered_shards_refused_total == 1


def test_recovery_reports_progress_over_all_shards(paths):
    fill(paths).close()
    calls: list = []
    with SsdTier(SsdConfig(paths=paths, capacity=32 << 20, recover=True), on_progress=lambda d, t: calls.append((d, t))) as t:
        assert t.snapshot().objects == N
    total = calls[0][1]
    assert total == 2 * (16 << 20) - 2 * 8192 and calls[-1] == (total, total)
    assert all(a[0] <= b[0] and a[1] == total for a, b in zip(calls, calls[1:]))
