"""Peers serve SSD-resident objects: a Manager whose objects live only on its SSD tier (real O_DIRECT file,
real io_uring) reads them back into DRAM when a peer leases them, so the peer restores them byte-exact.

As in ``test_peers_manager.py``, each Manager runs in its own process (the ``_CHILD`` program below: a real
:class:`Manager`, a shared-memory pages file, a :class:`PeerNode` with a real Transfer Engine), driven over
stdin/stdout with JSON lines."""

from __future__ import annotations

import pytest

from json_child import JsonChild, spawner
from orbitkv_fs.peers import transport_available
from test_ssd_common import direct_io_dir

pytestmark = pytest.mark.skipif(not transport_available(), reason="mooncake Transfer Engine not importable")

_CHILD = r'''
import hashlib, json, os, sys
import numpy as np
from orbitkv_fs.connectors.common import StagingPages
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.peers import PeerConfig, PeerNode
from orbitkv_fs.segment import Role

cfg = json.loads(sys.argv[1])
lower = None
if cfg.get("ssd"):
    from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
    lower = SsdTier(SsdConfig(paths=(cfg["ssd"],), capacity=64 << 20))
m = Manager(ManagerConfig(pool_size=32 << 20, device="cpu", ssd_prefetch_chunks=0), lower_tier=lower)
L, S = 2, 16
pages = StagingPages(num_layers=L, slots=S, block_size=16, num_heads=2, head_dim=64, dtype="float16")
info = m.register_engine(pages.registration(model="peer-ssd-test", engine_kind="generic", engine_id="e"))
node = PeerNode(m, peers=cfg.get("peers", []), config=PeerConfig(budget_s=5.0, staging_bytes=64 << 20))

def digest(blocks):
    h = hashlib.sha256()
    for l in range(L):
        for b in blocks:
            h.update(pages.key(l)[b].tobytes()); h.update(pages.value(l)[b].tobytes())
    return h.hexdigest()

def chunks(names, blocks):
    return [ChunkBlocks(chunk_key(n), [b]) for n, b in zip(names, blocks)]

print(json.dumps({"address": node.address, "namespace": info.namespace}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    op = c["op"]
    if op == "fill":
        rng = np.random.default_rng(c["seed"])
        for l in range(L):
            for arr in (pages.key(l), pages.value(l)):
                arr[c["blocks"]] = rng.standard_normal(arr[c["blocks"]].shape).astype(np.float16)
        out = {"digest": digest(c["blocks"])}
    elif op == "save":
        out = {"segments": m.save("e", chunks(c["names"], c["blocks"])).segments}
    elif op == "flush":
        out = {"submitted": m.flush_dram().submitted.objects}
    elif op == "flip":  # damage one segment's record on the SSD file
        key = ObjectKey(bytes.fromhex(info.namespace), chunk_key(c["name"]), 0, Role.KEY)
        rec = next(o for o in m.lower.iter_records() if o.key == key)
        fd = os.open(cfg["ssd"], os.O_RDWR)
        b = os.pread(fd, 1, rec.offset + 128 + 200)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), rec.offset + 128 + 200)
        os.fsync(fd); os.close(fd)
        out = {}
    elif op == "lookup":
        r = m.lookup("e", [chunk_key(n) for n in c["names"]], lease=False)
        out = {"count": r.count, "peer": r.peer}
    elif op == "restore":
        r = m.restore("e", chunks(c["names"], c["blocks"]))
        out = {"restored": r.restored, "digest": digest(c["blocks"])}
    elif op == "stats":
        st = m.stats()
        out = {"hits": st.hits, "dram_objects": st.resident_objects["dram"], "leases_active": st.leases_active,
               "reserved_bytes": st.reserved_bytes,
               "ssd_corrupt": st.lower.get("ssd_corrupt_records_total", 0.0)}
    print(json.dumps(out), flush=True)
node.close(); m.close(); pages.close()
'''


class Mgr(JsonChild):
    def __init__(self, **cfg):
        super().__init__(_CHILD, cfg)
        self.address, self.namespace = self.hello["address"], self.hello["namespace"]


@pytest.fixture
def managers():
    with spawner(Mgr) as make:
        yield make


def test_ssd_resident_prefix_restores_on_a_peer(managers, tmp_path):
    a = managers(ssd=str(direct_io_dir(tmp_path) / "a.okv"))
    b = managers(peers=[a.address])
    assert a.namespace == b.namespace
    names, blocks = [f"c{i}" for i in range(6)], list(range(6))
    want = a("fill", seed=7, blocks=blocks)["digest"]
    assert a("save", names=names, blocks=blocks)["segments"] == 6 * 2 * 2
    assert a("flush")["submitted"] == 24
    assert a("stats")["dram_objects"] == 0  # A holds the prefix on its SSD only
    assert b("lookup", names=names) == {"count": 6, "peer": 6}
    r = b("restore", names=names, blocks=blocks)
    assert r["restored"] == [True] * 6 and r["digest"] == want
    st = a("stats")
    assert st["hits"]["lower"] >= 24 and st["dram_objects"] == 24  # read back into A's DRAM to be leased
    assert st["leases_active"] == 0 and st["reserved_bytes"] == 0  # B released everything
    assert b("stats")["hits"]["peer"] == 24


def test_corrupt_ssd_record_is_not_served_to_a_peer(managers, tmp_path):
    a = managers(ssd=str(direct_io_dir(tmp_path) / "a.okv"))
    b = managers(peers=[a.address])
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
    assert a("stats")["leases_active"] == 0
