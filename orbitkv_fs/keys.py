"""Object keys: what the index, the tiers, the SSD records and peers call a cached segment.

An object is one segment of one chunk: ``(namespace, chunk, layer, role)``. ``namespace`` is the
16-byte storage namespace (v2) hash, ``chunk`` a 16-byte hash of the engine's chunk/block key (adapters
hash whatever their engine uses down to 16 bytes with :func:`chunk_key`). The packed form is fixed-size
(:data:`PACKED_SIZE` bytes) so that record headers and wire messages can carry it verbatim. A chunk's keys
are its 32-byte prefix (namespace + chunk) followed by a 4-byte (layer, role) tail (:func:`key_tails`,
:func:`segment_keys`). Packed keys sort chunk by chunk, so a listing in key order is one in prefix order
(:func:`page_of_chunks`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable, Iterable, Sequence

import msgspec

from .segment import Role

PACKED_SIZE = 36
#: The namespace's bytes at the start of a packed key and of its chunk prefix (namespace + chunk).
NS_BYTES = 16
_STRUCT = struct.Struct("<16s16sHB1x")
assert _STRUCT.size == PACKED_SIZE
_LAYER_ROLE = struct.Struct("<HB")  # at byte 32 of the packed form
_TAIL = struct.Struct("<HB1x")  # layer, role, pad: the packed form after namespace and chunk


def pack_key(namespace: bytes, chunk: bytes, layer: int, role: Role) -> bytes:
    """``ObjectKey(namespace, chunk, layer, role).pack()`` without building the object, for callers whose
    namespace and chunk are already checked 16-byte values (the Manager's per-segment loops)."""
    return _STRUCT.pack(namespace, chunk, layer, role)


def key_tails(layer_roles: Iterable[tuple[int, int]]) -> list[bytes]:
    """The last 4 bytes of the packed keys of ``(layer, role)`` pairs (:func:`pack_key` after namespace and
    chunk): an engine's table, made once, so that a chunk's keys are ``prefix + tail``
    (:func:`segment_keys`) without a pack per segment."""
    return [_TAIL.pack(layer, role) for layer, role in layer_roles]


def segment_keys(namespace: bytes, chunk: bytes, tails: Sequence[bytes]) -> list[bytes]:
    """``[pack_key(namespace, chunk, layer, role) for each pair]`` of :func:`key_tails`' ``tails``, for
    callers whose namespace and chunk are already checked 16-byte values."""
    prefix = namespace + chunk
    return [prefix + t for t in tails]


def page_of_chunks(prefixes: Iterable[bytes], rows_of: Callable[[bytes], list], after: bytes = b"",
                   limit: int | None = None, match_chunk: Callable[[bytes], bool] | None = None) -> list:
    """A page of a listing in packed-key order: the rows (each a tuple whose first item is its packed key) of
    the chunks among ``prefixes`` (32-byte prefixes) that ``match_chunk`` takes (all without it), whose key
    sorts after ``after``: chunk by chunk in prefix order, each chunk's rows from ``rows_of(prefix)``, until
    ``limit`` rows are in (at least; all without it). A page builds its own chunks' rows, not every object's
    and a sort of them all (both tiers list under their locks)."""
    floor = after[:32]
    rows: list = []
    for p in sorted(p for p in prefixes if p >= floor and (match_chunk is None or match_chunk(p))):
        if limit is not None and len(rows) >= limit:
            break
        chunk = sorted(rows_of(p))
        rows += chunk if p > floor else [r for r in chunk if r[0] > after]
    return rows


def key_layer_role(packed: bytes) -> tuple[int, int]:
    """``(layer, role value)`` of a packed key."""
    return _LAYER_ROLE.unpack_from(packed, 32)


def chunk_key(data: "bytes | str | int") -> bytes:
    """16-byte chunk key of an engine-side identifier (block hash, token-prefix digest, ...)."""
    if isinstance(data, int):
        data = data.to_bytes((max(data.bit_length(), 1) + 8) // 8, "little", signed=True)
    elif isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=16).digest()


class ObjectKey(msgspec.Struct, frozen=True, gc=False):
    """One object's key. Not tracked by Python's cycle collector (``gc=False``: it refers to bytes, an int and
    an enum member only, so it can be in no cycle): the SSD tier keeps one per record, and a full collection
    traverses every tracked object of the process while it holds the GIL
    (docs/results/2026-12-05-gc-pauses)."""

    namespace: bytes
    chunk: bytes
    layer: int
    role: Role

    def __post_init__(self) -> None:
        if len(self.namespace) != 16 or len(self.chunk) != 16:
            raise ValueError("namespace and chunk must be 16 bytes")
        if not 0 <= self.layer <= 0xFFFF:
            raise ValueError(f"layer {self.layer} outside 0..65535")

    def pack(self) -> bytes:
        return _STRUCT.pack(self.namespace, self.chunk, self.layer, int(self.role))

    @classmethod
    def unpack(cls, buf: "bytes | memoryview") -> "ObjectKey":
        ns, chunk, layer, role = _STRUCT.unpack(bytes(buf[:PACKED_SIZE]))
        return cls(ns, chunk, layer, Role(role))

    def __str__(self) -> str:
        return f"{self.namespace.hex()}/{self.chunk.hex()}/L{self.layer}/{self.role.name.lower()}"
