"""Shared helpers of the SSD tier tests: segments with deterministic content, keys, and a directory on a
file system that supports O_DIRECT (tmpfs does not)."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Role

NS = bytes(range(16))


def key(i: int, *, ns: bytes = NS, layer: int = 0) -> ObjectKey:
    return ObjectKey(ns, chunk_key(i), layer, Role.KEY)


def segment(i: int, *, n: int = 8192, layer: int = 0, version: int = 0) -> bytes:
    x = np.random.default_rng(i * 1000 + version).standard_normal(n).astype(np.float16)
    return encode_segment(x, "none", role="key", layer=layer)


def direct_io_dir(tmp_path: Path) -> Path:
    """``tmp_path`` when it takes O_DIRECT, else a scratch directory under the working directory."""
    for base in (tmp_path, Path.cwd() / ".ssd-test-scratch" / uuid.uuid4().hex):
        base.mkdir(parents=True, exist_ok=True)
        probe = base / ".odirect"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.close(fd)
            probe.unlink()
            return base
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    raise RuntimeError("no file system with O_DIRECT support for the SSD tests")


def flip(path: str, offset: int) -> None:
    """Flip one byte of a real shard file (through the page cache; O_DIRECT readers see it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
