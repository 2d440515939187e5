"""Shared-memory files that live exactly as long as the process that made them.

The Manager's arena and an engine's pages files (a connector's staging area, a CPU engine's KV) are tmpfs
files: their memory stays taken until the file is removed, and a process killed with SIGKILL (the OOM
killer, vLLM force-killing a worker that did not stop in time) removes nothing. So each such file carries
its owner's liveness with it, and whoever finds it stale may remove it.

Primitives:

* :func:`create_owned` -- a new file ``<prefix><pid>-<hex>`` in a directory, sized (its memory allocated at
  once where the filesystem can, else checked against the free space), with an exclusive ``flock`` that its
  creator holds for as long as it keeps the returned descriptor open.
* :func:`reclaim_stale` -- remove the files of one prefix whose lock nobody holds: their owners are dead.
* :class:`ShmSpaceError` -- the directory cannot hold the file.

Invariants: a file is visible under its final name only once it is locked (it is made under a hidden name,
locked, then renamed), so a reclaimer never takes a file being made; a reclaimer opens a candidate without
following links and without blocking (a FIFO or a symlink of that name is skipped, never waited on), and
removes only regular files whose lock it took; files of other names are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import uuid

from .errors import OrbitKVError

__all__ = ["ShmSpaceError", "create_owned", "reclaim_stale"]


class ShmSpaceError(OrbitKVError, OSError):
    """A shared-memory directory cannot hold a file asked of it (an OSError too: callers that survive a
    failed file, as the connectors do when they cannot stage, survive this one)."""


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _no_room(directory: str, size: int, free: int, what: str, hint: str) -> ShmSpaceError:
    return ShmSpaceError(f"{directory} has {free >> 20} MiB free, {what} takes {size >> 20} MiB: {hint}, or give the "
                         f"shared-memory directory more room (a container's /dev/shm: docker run --shm-size, or "
                         f"Kubernetes' emptyDir with medium: Memory)")


def _allocate(fd: int, size: int) -> bool:
    """Allocate the file's memory now (``posix_fallocate``); False where the filesystem cannot. Raises
    OSError(ENOSPC) when the directory runs out (tmpfs gives back what it allocated before it did)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return False
        raise
    return True


def size_file(fd: int, size: int, directory: str, *, reserve: bool, what: str, hint: str) -> None:
    """Give the open file ``size`` bytes. With ``reserve`` its memory is allocated now; otherwise (or where
    the filesystem cannot allocate) the directory's free space is checked first: a sparse tmpfs file written
    past what its tmpfs has left kills the writing process with SIGBUS. Raises :class:`ShmSpaceError`."""
    if reserve:
        try:
            if _allocate(fd, size):
                return
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise _no_room(directory, size, _free_bytes(directory), what, hint) from None
    free = _free_bytes(directory)
    if free < size:
        raise _no_room(directory, size, free, what, hint)
    os.ftruncate(fd, size)


def create_owned(directory: str, prefix: str, size: int, *, reserve: bool, what: str, hint: str,
                 hex_digits: int = 12) -> tuple[str, int]:
    """Create ``<directory>/<prefix><pid>-<hex>`` (mode 0600) of ``size`` bytes (:func:`size_file`), locked
    for as long as the returned descriptor stays open; answers (path, fd). Nothing is left on failure."""
    name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:hex_digits]}"
    tmp = os.path.join(directory, f".{name}.new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    path = tmp
    try:
        # Held until the owner closes the descriptor or dies: what tells reclaim_stale a live file, whatever
        # PID namespace its owner is in. Taken before the file has the name a reclaimer looks for.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        size_file(fd, size, directory, reserve=reserve, what=what, hint=hint)
        path = os.path.join(directory, name)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return path, fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def reclaim_stale(directory: str, prefix: str, *, hex_digits: int, dead_pid_only: bool = False) -> tuple[int, int]:
    """Remove the files ``<prefix><pid>-<hex>`` of ``directory`` whose exclusive flock can be taken (their
    owners are gone); answers (files, bytes) removed. ``dead_pid_only``: keep a file whose pid is a live
    process here too (files made before their owners locked them). A candidate that is not a regular file,
    is a symlink, is not ours to open or to remove, or went meanwhile is skipped."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]{%d}" % hex_digits)
    try:
        names = os.listdir(directory)
    except OSError:
        return 0, 0
    files = freed = 0
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or (dead_pid_only and _alive(int(m.group(1)))):
            continue
        path = os.path.join(directory, name)
        try:
            # O_NONBLOCK: anyone may make a FIFO of this name in a world-writable /dev/shm, and a plain open
            # of it would wait for a writer forever.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone meanwhile, a symlink, or not ours to open
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:  # BlockingIOError: its owner lives; else gone meanwhile, or not ours to remove
            continue
        finally:
            os.close(fd)
        files += 1
        freed += st.st_size
    return files, freed
