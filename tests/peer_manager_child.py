"""The Manager process the multi-Manager peer tests drive: a real :class:`Manager` (optionally with an SSD
tier on a real O_DIRECT file), a shared-memory pages file and a :class:`PeerNode` with a real Transfer
Engine, in its own process, over JSON lines (:mod:`json_child`). Tests start them with the ``managers``
fixture (conftest.py)."""

from __future__ import annotations

import os

from json_child import JsonChild
from polling import wait_until

_CHILD = r'''
import hashlib, json, mmap, os, signal, sys, threading
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
# No read-ahead: what a peer finds in DRAM or on SSD is only what the test put there.
m = Manager(ManagerConfig(pool_size=cfg.get("pool", 128 << 20), device="cpu", ssd_prefetch_chunks=0),
            lower_tier=lower)
L, S = cfg["layers"], cfg["slots"]
pages = StagingPages(num_layers=L, slots=S, block_size=16, num_heads=cfg["heads"], head_dim=64, dtype="float16")
info = m.register_engine(pages.registration(model="peer-test", engine_kind="generic", engine_id="e",
                                            codec=cfg.get("codec", "none")))
if cfg.get("die_after_lease_ms") is not None:
    lease = m.lease_objects
    def dying(keys):
        threading.Timer(cfg["die_after_lease_ms"] / 1000, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return lease(keys)
    m.lease_objects = dying
published = [0]  # segments peers wrote straight into the arena (publish() verifies them in place)
publish = m.publish
def counted_publish(res, key):
    published[0] += 1
    return publish(res, key)
m.publish = counted_publish
node = PeerNode(m, peers=cfg.get("peers", []), config=PeerConfig(budget_s=cfg.get("budget", 2.0),
                                                                   staging_bytes=64 << 20))

def digest(blocks):
    h = hashlib.sha256()
    for l in range(L):
        for b in blocks:
            h.update(pages.key(l)[b].tobytes()); h.update(pages.value(l)[b].tobytes())
    return h.hexdigest()

def chunks(names, blocks):
    return [ChunkBlocks(chunk_key(n), [b]) for n, b in zip(names, blocks)]

print(json.dumps({"address": node.address, "namespace": info.namespace, "pid": os.getpid(),
                  "pages": pages.pages.path}), flush=True)
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
        r = m.save("e", chunks(c["names"], c["blocks"]))
        out = {"segments": r.segments}
    elif op == "lookup":
        r = m.lookup("e", [chunk_key(n) for n in c["names"]], lease=False)
        out = {"count": r.count, "peer": r.peer}
    elif op == "restore":
        r = m.restore("e", chunks(c["names"], c["blocks"]))
        out = {"restored": r.restored, "digest": digest(c["blocks"]), "misses": [x.reason for x in r.misses]}
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
    elif op == "corrupt":
        key = ObjectKey(bytes.fromhex(info.namespace), chunk_key(c["name"]), 0, Role.KEY)
        lid, (ext,) = m.lease_objects([key])
        a = m.arena_info()
        with open(a.path, "r+b") as f, mmap.mmap(f.fileno(), a.size) as mm:
            mm[ext.offset + 64] ^= 0xFF  # first payload byte
        m.release(lid)
        out = {}
    elif op == "stats":
        import msgspec
        st = m.stats()
        out = {"peer": msgspec.to_builtins(node.stats()), "hits": st.hits, "leases_active": st.leases_active,
               "reserved_bytes": st.reserved_bytes, "published": published[0],
               "dram_objects": st.resident_objects["dram"],
               "ssd_corrupt": st.lower.get("ssd_corrupt_records_total", 0.0) if m.lower else 0.0}
    print(json.dumps(out), flush=True)
node.close(); m.close(); pages.close()
'''


class Mgr(JsonChild):
    def __init__(self, **cfg):
        # The Transfer Engine's own timeout at its floor: reads a killed peer leaves behind fail (and hand
        # back their arena reservations) within seconds, not the default 30 s.
        super().__init__(_CHILD, {"layers": 2, "slots": 16, "heads": 2, **cfg}, env={"MC_TRANSFER_TIMEOUT": "5"})
        self.address, self.namespace, self.pid = self.hello["address"], self.hello["namespace"], self.hello["pid"]

    def close(self) -> None:
        super().close()
        if os.path.exists(self.hello["pages"]):  # a child that was killed could not remove its pages
            os.unlink(self.hello["pages"])

    def settled_stats(self, timeout: float = 10.0) -> dict:
        """``stats`` once every peer lease is released (or ``timeout`` passed). A requester's release is
        one-way (it never waits for the answer), so it may land after the requester's restore has returned."""
        seen: dict = {}

        def released() -> bool:
            seen.update(self("stats"))
            return seen["leases_active"] == 0

        wait_until(released, timeout)
        return seen
