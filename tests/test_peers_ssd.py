"""Peers serve SSD-resident objects: a Manager whose objects live only on its SSD tier (real O_DIRECT file,
real io_uring) reads them back into DRAM when a peer leases them, so the peer restores them byte-exact.

As in ``test_peers_manager.py``, each Manager runs in its own process (:mod:`peer_manager_child`)."""

from __future__ import annotations

import pytest

from orbitkv_fs.peers import transport_available
from test_ssd_common import direct_io_dir

pytestmark = pytest.mark.skipif(not transport_available(), reason="mooncake Transfer Engine not importable")


def test_ssd_resident_prefix_restores_on_a_peer(managers, tmp_path):
    a = managers(ssd=str(direct_io_dir(tmp_path) / "a.okv"))
    b = managers(peers=[a.address], budget=5.0)
    assert a.namespace == b.namespace
    names, blocks = [f"c{i}" for i in range(6)], list(range(6))
    want = a("fill", seed=7, blocks=blocks)["digest"]
    assert a("save", names=names, blocks=blocks)["segments"] == 6 * 2 * 2
    assert a("flush")["submitted"] == 24
    assert a("stats")["dram_objects"] == 0  # A holds the prefix on its SSD only
    assert b("lookup", names=names) == {"count": 6, "peer": 6}
    r = b("restore", names=names, blocks=blocks)
    assert r["restored"] == [True] * 6 and r["digest"] == want
    st = a.settled_stats()
    assert st["hits"]["lower"] >= 24 and st["dram_objects"] == 24  # read back into A's DRAM to be leased
    assert st["leases_active"] == 0 and st["reserved_bytes"] == 0  # B released everything
    assert b("stats")["hits"]["peer"] == 24


def test_corrupt_ssd_record_is_not_served_to_a_peer(managers, tmp_path):
    a = managers(ssd=str(direct_io_dir(tmp_path) / "a.okv"))
    b = managers(peers=[a.address], budget=5.0)
    names, blocks = ["x0", "x1"], [0, 1]
    a("fill", seed=8, blocks=[0])
    want = a("fill", seed=9, blocks=[1])["digest"]
    a("save", names=names, blocks=blocks)
    a("flush")
    a("flip", name="x0")
    r = b("restore", names=names, blocks=blocks)
    assert r["restored"] == [False, True]  # x0 misses (one segment failed its CRC on A's SSD)
    assert a("stats")["ssd_corrupt"] == 1
    r = b("restore", names=["x1"], blocks=[1])
    assert r["restored"] == [True] and r["digest"] == want
    assert a.settled_stats()["leases_active"] == 0
