"""Test helper: the order of an eviction policy's linked list (``orbitkv_fs.tiers.eviction._Lists``)."""

from __future__ import annotations


def queue_order(lists, q: int = 0) -> list[int]:
    """Queue ``q`` 's slots from head to tail, checked against the walk from tail to head."""
    fwd, s = [], lists.head[q]
    while s != -1:
        fwd.append(s)
        s = lists.next[s]
    back, s = [], lists.tail[q]
    while s != -1:
        back.append(s)
        s = lists.prev[s]
    assert back[::-1] == fwd
    return fwd
