"""A real kernel file system whose disk can be made to fail: FUSE over a backing directory, for tests.

Run as ``python faultyfs.py BACKING MOUNTPOINT CONTROL`` (root, or a user allowed to mount FUSE). Every
file operation passes through to BACKING, until CONTROL (a JSON file, re-read when it changes) says
otherwise:

* ``"read_eio": [[name, offset, length], ...]``: a read overlapping that byte range of that file fails
  with EIO, as a disk's unreadable sectors do;
* ``"write_errno": "EIO" | "ENOSPC"``: every write fails so (a dying disk, a thin-provisioned one that is
  full);
* ``"hang_reads": true``: reads wait until the flag is cleared (a disk or link that stops answering reads);
  ``"hang": true``: reads, writes and syncs wait so (a disk that stops answering at all);
* ``"corrupt": [[name, offset], ...]``: a read covering that byte answers it flipped (bit rot under a
  checksum-less disk).

The process answers ``CONTROL + ".seen"`` with the number of reads and writes it served, so that a test
knows the I/O went through it. Calls from the kernel reach it on FUSE's own threads: a hung read holds only
its own. The kernel may hold 1,024 requests of it in the background (FUSE's default, 12, makes a thirteenth
io_uring submission wait in ``io_uring_enter``, which a block device's queue does not): a hung disk then
looks to the tier as a hung NVMe drive does. Files are cached by the kernel as a disk's are (no
``direct_io``), so a mapping of an unreadable block faults as it would on a disk.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time

import mfusepy as fuse


class FaultyFs(fuse.Operations):
    def __init__(self, backing: str, control: str) -> None:
        self.root = backing
        self.control = control
        self._mtime = -1.0
        self._rules: dict = {}
        self._lock = threading.Lock()
        self.reads = self.writes = 0

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _rule(self, name: str):
        try:
            m = os.stat(self.control).st_mtime
        except FileNotFoundError:
            m = 0.0
        with self._lock:
            if m != self._mtime:
                self._mtime = m
                try:
                    with open(self.control) as f:
                        self._rules = json.load(f)
                except (FileNotFoundError, ValueError):
                    self._rules = {}
            return self._rules.get(name)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)
            with open(self.control + ".seen.tmp", "w") as f:
                json.dump({"reads": self.reads, "writes": self.writes}, f)
            os.replace(self.control + ".seen.tmp", self.control + ".seen")

    # -- the file system: a passthrough --

    def init_with_config(self, conn_info, config_3):
        if conn_info is not None:
            conn_info.max_background = 1024
            conn_info.congestion_threshold = 1000

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                            "st_size", "st_uid", "st_blocks")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def statfs(self, path):
        s = os.statvfs(self._path(path))
        return {k: getattr(s, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                           "f_files", "f_flag", "f_frsize", "f_namemax")}

    def open(self, path, flags):
        return os.open(self._path(path), flags & ~os.O_DIRECT)

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def release(self, path, fh):
        os.close(fh)
        return 0

    def flush(self, path, fh):
        return 0

    def _hang(self, reads: bool = False) -> None:
        while self._rule("hang") or (reads and self._rule("hang_reads")):
            time.sleep(0.01)

    def fsync(self, path, datasync, fh):
        self._hang()
        os.fsync(fh)
        return 0

    def truncate(self, path, length, fh=None):
        os.truncate(self._path(path), length)
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        if mode:
            raise fuse.FuseOSError(errno.EOPNOTSUPP)
        os.posix_fallocate(fh, offset, size)
        return 0

    def unlink(self, path):
        os.unlink(self._path(path))
        return 0

    def rename(self, old, new):
        os.rename(self._path(old), self._path(new))
        return 0

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)
        return 0

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)
        return 0

    use_ns = True

    def utimens(self, path, times=None):
        os.utime(self._path(path), ns=times)
        return 0

    def read(self, path, size, offset, fh):
        name = path.lstrip("/")
        self._hang(reads=True)
        for f, o, n in self._rule("read_eio") or ():
            if f == name and o < offset + size and offset < o + n:
                self._count("reads")
                raise fuse.FuseOSError(errno.EIO)
        data = os.pread(fh, size, offset)
        for f, o in self._rule("corrupt") or ():
            if f == name and offset <= o < offset + len(data):
                b = bytearray(data)
                b[o - offset] ^= 0xFF
                data = bytes(b)
        self._count("reads")
        return data

    def write(self, path, data, offset, fh):
        self._hang()
        code = self._rule("write_errno")
        self._count("writes")
        if code:
            raise fuse.FuseOSError(getattr(errno, code))
        return os.pwrite(fh, data, offset)


def main() -> None:
    backing, mountpoint, control = sys.argv[1:4]
    fuse.FUSE(FaultyFs(backing, control), mountpoint, foreground=True, nothreads=False)

if __name__ == "__main__":
    main()
