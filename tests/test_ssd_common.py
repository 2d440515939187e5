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


def shard_superblock(path: str):
    """The current superblock of a shard file (the test runs as the Manager's user: it may read it)."""
    from orbitkv_fs.tiers.ssd.superblock import RING_START, read_superblocks

    with open(path, "rb") as f:
        sb, _ = read_superblocks(f.read(RING_START))
    assert sb is not None, f"{path} has no valid superblock"
    return sb


def shard_key(path: str):
    from orbitkv_fs.tiers.ssd.record import ShardKey

    return ShardKey(shard_superblock(path).secret)


def read_header(path: str, offset: int):
    """The record header at ``offset`` of a shard file (parsed, not verified)."""
    from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE, parse_record_header

    with open(path, "rb") as f:
        f.seek(offset)
        return parse_record_header(f.read(RECORD_HEADER_SIZE))


def record_image(path: str, offset: int, k: ObjectKey, generation: int, seg: bytes, prev: tuple[int, bytes],
                 *, key=None) -> bytes:
    """The bytes of a segment record for ``k`` at ``offset`` of ``path``'s log, tagged under the shard's
    secret (or ``key``: an attacker's guess), linking to ``prev`` = ``(offset, tag)``."""
    from orbitkv_fs.tiers.ssd.record import Kind, pack_record_header_into, record_length, write_record_body

    buf = memoryview(bytearray(record_length(len(seg))))
    write_record_body(buf, seg)
    pack_record_header_into(buf, key or shard_key(path), Kind.SEGMENT, k.pack(), generation, len(seg), offset, *prev)
    return bytes(buf)


def pwrite(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
