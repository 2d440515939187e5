"""A DRAM tier holding N objects of 400 bytes, 16 segments a chunk of namespace ``b"n" * 16``: the setup of
invalidate_cost.py, drain_cost.py and listing_cost.py."""

from __future__ import annotations

from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import UNIT, DramTier

PER = 16
NS = b"n" * 16


def filled_tier(n: int) -> DramTier:
    t = DramTier(n * UNIT + (1 << 20), pin=False)
    for c in range(n // PER):
        keys = [ObjectKey(NS, c.to_bytes(16, "little"), layer, role).pack()
                for layer in range(PER // 2) for role in (Role.KEY, Role.VALUE)]
        offs = t.reserve_many([400] * PER)
        t.publish_many(keys, offs, [400] * PER, [400] * PER, [0] * PER)
    return t
