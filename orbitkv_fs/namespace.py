"""Storage namespace v2: the 16-byte hash under which an engine's segments are stored.

Owns :func:`namespace_v2`, the one definition of "these bytes are interchangeable". It hashes (BLAKE2b-128
over a canonical msgpack document): the namespace version, the segment format version, the codec name and
its parameters and version, the geometry that decides segment contents (block size, heads, head dim, dtype,
per-layer layout/role/attention, the stage's layer range and layer count), the rotation seed, the model
identity (name and revision) and the TP/PP rank and sizes.

Invariants: the number of blocks, strides and handles are not hashed (they change with the engine's memory
budget, not with what a segment holds); any field that changes segment bytes is hashed; Managers never serve
bytes across namespaces, because every :class:`~orbitkv_fs.keys.ObjectKey` carries the namespace.
"""

from __future__ import annotations

import hashlib

import msgspec

from .geometry import EngineRegistration, layer_attention, parse_dtype
from .segment import HEADER_VERSION

NAMESPACE_VERSION = 2
#: Version of the codec family parameters hashed here; bump when a codec's bytes change.
CODEC_VERSION = 1


def namespace_v2(reg: EngineRegistration, codec: str) -> bytes:
    """16-byte storage namespace of ``reg`` stored with ``codec`` (the codec actually in effect)."""
    layers = sorted(
        (d.layer, d.role, d.layout, layer_attention(reg, d).value, str(parse_dtype(d.dtype)),
         list(d.shape[1:]) if d.layout == "state" else [])
        for d in reg.tensors
    )
    doc = {
        "v": NAMESPACE_VERSION,
        "format": HEADER_VERSION,
        "codec": codec,
        "codec_version": CODEC_VERSION,
        "rotation_seed": reg.rotation_seed if codec.startswith("turboquant") else 0,
        "head_layout_verified": reg.head_layout_verified,
        "model": [reg.model, reg.model_revision],
        "geometry": [reg.num_layers, reg.layer_start, reg.layer_end, reg.block_size, reg.num_heads,
                     reg.head_dim, str(parse_dtype(reg.dtype)), reg.attention, layers],
        "rank": [reg.tp_rank, reg.tp_size, reg.pp_rank, reg.pp_size],
    }
    return hashlib.blake2b(msgspec.msgpack.encode(doc), digest_size=16).digest()
