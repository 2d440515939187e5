"""The shard superblock: who the shard is, its secret, and the checkpoint of its log.

The first :data:`RING_START` bytes of a shard file hold two copies of the superblock, in blocks 0 and 1
(a checkpoint overwrites the older copy, so a write torn by a crash leaves the other one whole); the ring
of records starts after them. Records never reach these blocks, so no KV content can land there.

Superblock (little endian, the first :data:`SUPERBLOCK_SIZE` bytes of its block, the rest zero)::

    0    4s   magic "OKVB"
    4    H    version (1)
    6    H    reserved, zero
    8    I    shard index
    12   I    shard count
    16   Q    capacity (bytes of the shard file the ring may use)
    24   Q    sequence (every write adds one; the valid copy with the larger sequence is current)
    32   32s  secret (secrets.token_bytes(32) when the shard file was created)
    64   Q    checkpoint generation W: every record of this shard with a generation <= W was durable
    72   Q    checkpoint head offset: the newest record of the shard with a generation <= W (NO_PREV: none)
    80   16s  checkpoint head tag
    96   Q    floor: no record with a generation <= floor is ever adopted (invalidation of everything)
    104  Q    generations allocated up to here (the next session starts above it)
    112  16s  tag: keyed BLAKE2b-128 of bytes 0..111 under the secret (domain "orbitkv-superbk")

Primitives: :class:`Superblock`, :func:`pack_superblock`, :func:`parse_superblock` (one copy),
:func:`read_superblocks` (both copies: the current one and what is wrong with each), :func:`new_secret`,
:func:`copy_offset` (where the copy of a sequence number goes).

Invariants: a parsed superblock's tag verified under its own secret and every field is in range
(generations <= GEN_MAX, offsets block-aligned and inside the ring, sequence >= 1); failures are typed
:class:`~orbitkv_fs.errors.SegmentError` subclasses, never another exception.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from dataclasses import dataclass

from ...errors import BadMagic, LengthMismatch, SegmentError, TruncatedSegment, UnknownFormat, UnsupportedVersion
from .record import BLOCK, GEN_MAX, NO_PREV, NO_TAG, TAG_SIZE, RecordTagMismatch, ShardKey

MAGIC = b"OKVB"
VERSION = 1
SUPERBLOCK_SIZE = 128
COPIES = 2
#: The first byte of the ring: the superblock copies come before it.
RING_START = COPIES * BLOCK

_STRUCT = struct.Struct("<4sHHIIQQ32sQQ16sQQ16s")
assert _STRUCT.size == SUPERBLOCK_SIZE
_TAG_AT = SUPERBLOCK_SIZE - TAG_SIZE  # the tag covers bytes 0.._TAG_AT-1


@dataclass(frozen=True, slots=True)
class Superblock:
    shard_index: int
    shard_count: int
    capacity: int
    sequence: int
    secret: bytes
    checkpoint_generation: int
    checkpoint_offset: int
    checkpoint_tag: bytes
    floor: int
    generations: int


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def copy_offset(sequence: int) -> int:
    """Where the superblock of ``sequence`` goes: the copies alternate, so the previous one stays whole."""
    return (sequence % COPIES) * BLOCK


def pack_superblock(sb: Superblock) -> bytes:
    """The :data:`BLOCK` bytes of ``sb``'s copy, tag included."""
    _check(sb)
    body = _STRUCT.pack(MAGIC, VERSION, 0, sb.shard_index, sb.shard_count, sb.capacity, sb.sequence, sb.secret,
                        sb.checkpoint_generation, sb.checkpoint_offset, sb.checkpoint_tag, sb.floor,
                        sb.generations, NO_TAG)
    tag = ShardKey(sb.secret).superblock_tag(body[:_TAG_AT])
    return body[:_TAG_AT] + tag + bytes(BLOCK - SUPERBLOCK_SIZE)


def _check(sb: Superblock) -> None:
    if not (len(sb.secret) == 32 and sb.sequence >= 1 and sb.shard_count >= 1 and 0 <= sb.shard_index < sb.shard_count
            and sb.capacity % BLOCK == 0 and sb.capacity > RING_START and len(sb.checkpoint_tag) == TAG_SIZE):
        raise LengthMismatch("superblock identity fields out of range")
    if not (0 <= sb.checkpoint_generation <= GEN_MAX and 0 <= sb.floor <= GEN_MAX and 0 <= sb.generations <= GEN_MAX):
        raise LengthMismatch("superblock generation beyond GEN_MAX")
    if sb.checkpoint_generation == 0:
        if sb.checkpoint_offset != NO_PREV or sb.checkpoint_tag != NO_TAG:
            raise LengthMismatch("superblock checkpoint head without a checkpoint")
    elif (sb.checkpoint_offset % BLOCK or not RING_START <= sb.checkpoint_offset < sb.capacity
          or sb.checkpoint_generation > sb.generations):
        raise LengthMismatch("superblock checkpoint head outside the ring")


def parse_superblock(buf: "bytes | memoryview") -> Superblock:
    """Decode and verify one superblock copy (its first :data:`SUPERBLOCK_SIZE` bytes)."""
    mv = memoryview(buf)
    if len(mv) < SUPERBLOCK_SIZE:
        raise TruncatedSegment(f"a superblock is {SUPERBLOCK_SIZE} bytes, {len(mv)} present")
    (magic, version, reserved, index, count, capacity, seq, secret, ckpt_gen, ckpt_off, ckpt_tag, floor, gens,
     tag) = _STRUCT.unpack_from(mv)
    if magic != MAGIC:
        raise BadMagic("not a shard superblock")
    if version != VERSION:
        raise UnsupportedVersion(f"superblock version {version} (this build reads {VERSION})")
    if reserved:
        raise UnknownFormat("reserved superblock bytes are not zero")
    if not hmac.compare_digest(ShardKey(secret).superblock_tag(mv[:_TAG_AT]), tag):
        raise RecordTagMismatch("superblock tag does not verify")
    sb = Superblock(index, count, capacity, seq, secret, ckpt_gen, ckpt_off, ckpt_tag, floor, gens)
    _check(sb)
    return sb


def read_superblocks(image: "bytes | memoryview") -> tuple[Superblock | None, list[str]]:
    """The current superblock of a shard image (the valid copy with the larger sequence; None when no copy
    verifies) and, per copy, what is wrong with it ("" when it verified)."""
    mv = memoryview(image)
    best: Superblock | None = None
    errors: list[str] = []
    for i in range(COPIES):
        try:
            sb = parse_superblock(mv[i * BLOCK:i * BLOCK + SUPERBLOCK_SIZE])
        except SegmentError as e:
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if copy_offset(sb.sequence) != i * BLOCK:  # a copy is only ever written to its own block
            errors.append(f"copy of sequence {sb.sequence} in block {i}")
            continue
        errors.append("")
        if best is None or sb.sequence > best.sequence:
            best = sb
    return best, errors
