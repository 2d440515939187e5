"""Host time per segment of the save path's batch operations, this tree against its base, in one process.

* ``publish``: ``DramTier.publish_many`` of 32 chunks x 72 segments (2,304 items), on a fresh tier (new
  index rows) and on a tier whose previous round was invalidated (rows from the free list), each eviction
  policy.
* ``plan``: a save's planning of 32 chunks x 72 segments of a 36-layer K/V host engine (fp8, so that every
  segment goes to the codec batches): ``_save_items`` and the batch cut, consumed without encoding.

The base's code (``--base``, default: the commit this branch started from) is loaded from
``git show <base>:<path>`` into modules of its own (its index, eviction policy and DRAM tier; its
``_save_items`` and ``_codec_batches`` bound to the same Manager), so both run in this process, on the same
data, in alternating rounds (the order flips each round). Figures: median of the rounds, µs per segment.

    python docs/results/2026-12-02-save-batch/bench_save_batch.py --rounds 15 --out docs/results/2026-12-02-save-batch/result.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import types

import numpy as np

import orbitkv_fs.manager.save as new_save
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration, Manager, ManagerConfig
from orbitkv_fs.pages import host_engine_pages
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.dram import DramTier

CHUNKS, LAYERS = 32, 36


BASE = "385478cdfb4a20c7da6f86e3071a104c6fd69446"  # wt24b's base: main when issue 24's save work began


def _base_module(name: str, path: str, package: str, rewrite: dict[str, str] | None = None) -> types.ModuleType:
    """``path`` as of the base commit, as module ``name`` (relative imports resolve in ``package``)."""
    src = subprocess.run(["git", "show", f"{BASE}:{path}"], check=True, capture_output=True, text=True).stdout
    for a, b in (rewrite or {}).items():
        assert a in src, (path, a)
        src = src.replace(a, b)
    mod = types.ModuleType(name)
    mod.__package__ = package
    mod.__file__ = f"{BASE}:{path}"
    sys.modules[name] = mod
    exec(compile(src, f"{BASE}:{path}", "exec"), mod.__dict__)
    return mod


def load_base() -> dict:
    _base_module("orbitkv_fs._base_index", "orbitkv_fs/index.py", "orbitkv_fs")
    _base_module("orbitkv_fs.tiers._base_eviction", "orbitkv_fs/tiers/eviction.py", "orbitkv_fs.tiers")
    dram = _base_module("orbitkv_fs.tiers._base_dram", "orbitkv_fs/tiers/dram.py", "orbitkv_fs.tiers",
                        {"from ..index import": "from .._base_index import",
                         "from .eviction import": "from ._base_eviction import"})
    batching = _base_module("orbitkv_fs.manager._base_batching", "orbitkv_fs/manager/batching.py", "orbitkv_fs.manager")
    save = _base_module("orbitkv_fs.manager._base_save", "orbitkv_fs/manager/save.py", "orbitkv_fs.manager")
    return {"DramTier": dram.DramTier, "_save_items": save.SavePipeline._save_items,
            "_codec_batches": batching.Batching._codec_batches, "_source_bytes": save._source_bytes}


def publish_items(tier, base: int, chunks: int, segs: int) -> list:
    keys = [ObjectKey(bytes(16), chunk_key(base + c), layer, role).pack()
            for c in range(chunks) for layer in range(segs // 2) for role in (Role.KEY, Role.VALUE)]
    offs = tier.reserve_many([1000] * len(keys))
    return [(k, off, 1000, 2000, 2) for k, off in zip(keys, offs)]


def bench_publish(impls: dict, rounds: int, policy: str) -> dict:
    n = CHUNKS * 2 * LAYERS
    out: dict = {name: {"fresh": [], "reused": []} for name in impls}
    tiers = {name: cls(64 << 20, policy=policy, pin=False) for name, cls in impls.items()}
    try:
        for r in range(rounds):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for name in order:
                fresh = impls[name](64 << 20, policy=policy, pin=False)
                try:
                    items = publish_items(fresh, r * CHUNKS, CHUNKS, 2 * LAYERS)
                    t0 = time.perf_counter()
                    assert all(fresh.publish_many(items))
                    out[name]["fresh"].append((time.perf_counter() - t0) / n * 1e6)
                finally:
                    fresh.close()
                t = tiers[name]
                items = publish_items(t, r * CHUNKS, CHUNKS, 2 * LAYERS)
                t0 = time.perf_counter()
                assert all(t.publish_many(items))
                dt = time.perf_counter() - t0
                if r:  # round 0 made the rows the later rounds reuse
                    out[name]["reused"].append(dt / n * 1e6)
                t.invalidate(lambda k: True)
                assert len(t.index._free) >= n
    finally:
        for t in tiers.values():
            t.close()
    return out


def bench_plan(base: dict, rounds: int) -> dict:
    pages, descs = host_engine_pages(num_layers=LAYERS, num_blocks=CHUNKS * 4, block_size=16, num_heads=2,
                                     head_dim=64)
    try:
        reg = EngineRegistration(model="bench", num_layers=LAYERS, layer_start=0, layer_end=LAYERS, block_size=16,
                                 num_heads=2, head_dim=64, dtype="bfloat16", tensors=descs)
        with Manager(ManagerConfig(pool_size=64 << 20, storage_codec="fp8", device="cpu")) as m:
            e = m.register_engine(reg)
            eng = m._engines[e.engine_id]
            chunks = [ChunkBlocks(chunk_key(f"p{i}"), list(range(4 * i, 4 * i + 4))) for i in range(CHUNKS)]
            n = CHUNKS * len(eng.segs)
            old_items = types.MethodType(base["_save_items"], m)
            old_batches = types.MethodType(base["_codec_batches"], m)

            def run_base() -> list:
                todo: list = []
                items = old_items(eng, chunks, todo, new_save._SaveAcc())
                return list(old_batches(items, lambda it: it[1].coded_bound(len(it[0].blocks)), base["_source_bytes"]))

            def run_new() -> list:
                todo: list = []
                return list(m._run_batches(m._save_items(eng, chunks, todo, new_save._SaveAcc())))

            runs = {"base": run_base, "this": run_new}
            a, b = run_base(), run_new()
            assert a == b and sum(map(len, a)) == n, "the two plans differ"
            out: dict = {"base": [], "this": [], "batches": len(a)}
            for r in range(rounds):
                for name in (["base", "this"] if r % 2 == 0 else ["this", "base"]):
                    t0 = time.perf_counter()
                    runs[name]()
                    out[name].append((time.perf_counter() - t0) / n * 1e6)
            return out
    finally:
        pages.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--base", default=BASE, help="the commit whose code is the baseline")
    args = ap.parse_args()
    globals()["BASE"] = args.base
    old = load_base()
    res: dict = {"command": " ".join(["python"] + sys.argv), "rounds": args.rounds,
                 "host": f"{platform.node()} {platform.processor() or platform.machine()} python {platform.python_version()}",
                 "code": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
                 "base": args.base,
                 "segments": CHUNKS * 2 * LAYERS, "publish": {}, "plan": {}}
    for policy in ("lru", "s3fifo"):
        raw = bench_publish({"base": old["DramTier"], "this": DramTier}, args.rounds, policy)
        res["publish"][policy] = {name: {case: {"median_us_per_segment": statistics.median(v), "rounds_us": v}
                                         for case, v in cases.items()} for name, cases in raw.items()}
    raw = bench_plan(old, args.rounds)
    res["plan"] = {"batches": raw["batches"]} | {name: {"median_us_per_segment": statistics.median(raw[name]),
                                                        "rounds_us": raw[name]} for name in ("base", "this")}
    lines = ["| operation | base µs/segment | this µs/segment | speed-up |", "| --- | --- | --- | --- |"]
    for policy, r in res["publish"].items():
        for case in ("fresh", "reused"):
            a, b = r["base"][case]["median_us_per_segment"], r["this"][case]["median_us_per_segment"]
            lines.append(f"| publish_many, {policy}, {case} rows | {a:.3f} | {b:.3f} | {a / b:.1f}x |")
    a, b = res["plan"]["base"]["median_us_per_segment"], res["plan"]["this"]["median_us_per_segment"]
    lines.append(f"| save planning (items + batch cut) | {a:.3f} | {b:.3f} | {a / b:.1f}x |")
    print("\n".join(lines))
    res["table"] = lines
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
