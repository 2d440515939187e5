"""A Manager process with an SSD tier, driven over JSON lines (:mod:`json_child`): what the trust tests
(forged records in KV pages, durable invalidation under SIGKILL) run as the process that is attacked or
killed. Engines' pages and the DRAM arena live in the test's directory, not in /dev/shm, so a killed
child leaves nothing behind there.

Commands: ``engine`` (register host pages, filled from a seed), ``forge`` (write bytes into an engine's
pages at a payload offset of a chunk), ``save`` (and ``flush_dram``), ``segment`` (a stored segment),
``records`` (the tier's published records), ``invalidate``, ``stats``, ``close``."""

from __future__ import annotations

from typing import Any

from json_child import JsonChild

PROGRAM = r'''
import json, os, sys
import ml_dtypes
import numpy as np
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration, Manager, ManagerConfig
from orbitkv_fs.pages import host_engine_pages
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

cfg = json.loads(sys.argv[1])
d = cfg["dir"]
tier = SsdTier(SsdConfig(paths=tuple(cfg["paths"]), capacity=cfg["capacity"], recover=cfg.get("recover", False)))
m = Manager(ManagerConfig(pool_size=cfg.get("pool", 4 << 20), storage_codec="none", shm_dir=d,
                          ssd_prefetch_chunks=0), lower_tier=tier)
engines = {}


def fill(pages, seed):
    rng = np.random.default_rng(seed)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = (rng.standard_normal(a.shape) * 2).astype(ml_dtypes.bfloat16)


print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    op = c["op"]
    out = {}
    if op == "engine":
        layout = c.get("layout", "mla")
        pages, descs = host_engine_pages(num_layers=c.get("layers", 1), num_blocks=c["blocks"], block_size=16,
                                         num_heads=2, head_dim=64, layout=layout, directory=d)
        fill(pages, c["seed"])
        reg = EngineRegistration(model=c["name"], num_layers=c.get("layers", 1), layer_start=0,
                                 layer_end=c.get("layers", 1), block_size=16, num_heads=2, head_dim=64,
                                 dtype="bfloat16", tensors=descs, attention="mla" if layout == "mla" else "gqa")
        e = m.register_engine(reg)
        engines[c["name"]] = (pages, e)
        out = {"namespace": e.namespace}
    elif op == "forge":
        pages, _ = engines[c["name"]]
        name = next(iter(pages.tensors))
        flat = pages.array(name)[c["blocks"][0]:c["blocks"][-1] + 1].view(np.uint8).reshape(-1)
        image = bytes.fromhex(c["image"])
        flat[c["at"]:c["at"] + len(image)] = np.frombuffer(image, np.uint8)
    elif op == "save":
        pages, e = engines[c["name"]]
        r = m.save(e.engine_id, [ChunkBlocks(chunk_key(n), b) for n, b in c["chunks"]])
        out = {"segments": r.segments}
        if c.get("flush"):
            f = m.flush_dram()
            out["flushed"] = f.submitted.objects
            out["dropped"] = f.dropped.objects
    elif op == "segment":
        _, e = engines[c["name"]]
        k = ObjectKey(bytes.fromhex(e.namespace), chunk_key(c["chunk"]), c.get("layer", 0), Role(c.get("role", 0)))
        blob = m.read_object(k)
        out = {"segment": blob.hex() if blob is not None else None}
    elif op == "records":
        out = {"records": [[o.key.namespace.hex(), o.key.chunk.hex(), o.key.layer, int(o.key.role), o.shard,
                            o.offset, o.generation] for o in tier.iter_records()]}
    elif op == "invalidate":
        kw = {}
        if "engine" in c:
            kw["engine_id"] = engines[c["engine"]][1].engine_id
        if "chunks" in c:
            kw["chunks"] = [chunk_key(n) for n in c["chunks"]]
        if "keys" in c:
            ns = bytes.fromhex(engines[c["keys"]["engine"]][1].namespace)
            kw["keys"] = [ObjectKey(ns, chunk_key(n), layer, Role(role)) for n, layer, role in c["keys"]["list"]]
        r = m.invalidate(**kw)
        out = {"dram": r.dram.objects, "lower": r.lower.objects}
    elif op == "stats":
        s = tier.snapshot()
        out = {"objects": s.objects, "write_errors_total": s.write_errors_total, "evicted_total": s.evicted_total}
    elif op == "close":
        m.close()
        for pages, _ in engines.values():
            pages.close()
        print(json.dumps({}), flush=True)
        break
    print(json.dumps(out), flush=True)
'''


class SsdManager(JsonChild):
    """``SsdManager(dir=..., paths=[...], capacity=...)``: a Manager + SSD tier in a child process."""

    def __init__(self, **cfg: Any) -> None:
        super().__init__(PROGRAM, cfg)
