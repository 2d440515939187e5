"""The DRAM arena against the room in its directory.

A tmpfs file is sparse: a Manager whose pool is larger than what its /dev/shm has left (a container's is 64 MiB
unless sized) used to start, report ready, and die of SIGBUS at the first write past the end of the tmpfs,
with every cached object. The arena is now refused at start with :class:`ShmSpaceError`, and with ``reserve``
(the server's default, ``--reserve-pool``) its memory is allocated at once.

The tests on a real tmpfs mount one of 16 MiB (root with CAP_SYS_ADMIN); elsewhere they skip, and the
monkeypatched ones still check the logic.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orbitkv_fs import shmfiles
from orbitkv_fs.shmfiles import ShmSpaceError
from orbitkv_fs.tiers.dram import ARENA_PREFIX, Arena


def _arenas(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if ARENA_PREFIX in n]  # a hidden one being made included


class _Statvfs:
    def __init__(self, free: int) -> None:
        self.f_bavail, self.f_frsize = free // 4096, 4096


@pytest.mark.parametrize("reserve", [False, True])
def test_a_pool_its_directory_cannot_hold_is_refused_and_leaves_nothing(reserve, tmp_path, monkeypatch):
    monkeypatch.setattr(shmfiles.os, "statvfs", lambda d: _Statvfs(4 << 20))
    if reserve:  # the filesystem's own refusal: tmpfs answers ENOSPC
        def enospc(fd, offset, size):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(shmfiles.os, "posix_fallocate", enospc)
    with pytest.raises(ShmSpaceError) as e:
        Arena(8 << 20, shm_dir=str(tmp_path), pin=False, reserve=reserve)
    assert f"{tmp_path} has 4 MiB free, the DRAM pool takes 8 MiB" in str(e.value)
    assert "--pool-size" in str(e.value) and "--shm-size" in str(e.value)
    assert _arenas(tmp_path) == []


def test_a_filesystem_without_fallocate_falls_back_to_the_free_space_check(tmp_path, monkeypatch):
    def unsupported(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(shmfiles.os, "posix_fallocate", unsupported)
    a = Arena(1 << 20, shm_dir=str(tmp_path), pin=False, reserve=True)
    try:
        assert a.size == 1 << 20 and os.path.getsize(a.path) == 1 << 20
    finally:
        a.close()
    monkeypatch.setattr(shmfiles.os, "statvfs", lambda d: _Statvfs(512 << 10))
    with pytest.raises(ShmSpaceError):
        Arena(1 << 20, shm_dir=str(tmp_path), pin=False, reserve=True)
    assert _arenas(tmp_path) == []


def _used(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_on_a_real_tmpfs_a_sparse_file_past_its_end_kills_and_the_arena_is_refused_first(small_tmpfs):
    # The hazard itself: a sparse 32 MiB file on a 16 MiB tmpfs, written through a mapping -> SIGBUS.
    probe = textwrap.dedent(f"""
        import mmap, os
        fd = os.open({str(small_tmpfs / 'sparse')!r}, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 32 << 20)
        m = mmap.mmap(fd, 32 << 20)
        m[:] = b"x" * (32 << 20)
        print("written")
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == -7, (r.returncode, r.stdout, r.stderr)  # SIGBUS
    os.unlink(small_tmpfs / "sparse")
    for reserve in (False, True):
        with pytest.raises(ShmSpaceError):
            Arena(32 << 20, shm_dir=str(small_tmpfs), pin=False, reserve=reserve)
        assert _arenas(small_tmpfs) == [] and _used(small_tmpfs) == 0
    # A pool that fits: reserved, its memory is the tmpfs's at once and given back on close.
    a = Arena(12 << 20, shm_dir=str(small_tmpfs), pin=False, reserve=True)
    try:
        assert _used(small_tmpfs) >= 12 << 20
        a.buf[:] = 7  # every byte of it writable
        with pytest.raises(ShmSpaceError):  # what is left cannot hold a second one
            Arena(8 << 20, shm_dir=str(small_tmpfs), pin=False, reserve=True)
    finally:
        a.close()
    assert _used(small_tmpfs) == 0 and _arenas(small_tmpfs) == []


def test_the_server_refuses_a_pool_its_shm_dir_cannot_hold(small_tmpfs):
    argv = [sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "32mib", "--device", "cpu",
            "--shm-dir", str(small_tmpfs), "--http-addr", "127.0.0.1:0", "--data-plane", "tcp://127.0.0.1:0"]
    for extra in ([], ["--no-reserve-pool"]):
        r = subprocess.run(argv + extra, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
        assert f"{small_tmpfs} has 16 MiB free, the DRAM pool takes 32 MiB" in r.stderr, r.stderr[-2000:]
        assert _arenas(small_tmpfs) == [] and _used(small_tmpfs) == 0
