"""When does vLLM's first attention layer get its KV? The OrbitKV-FS vLLM connector's load, timed.

A real Manager behind the real data plane (``ipc://``), a worker connector whose KV caches are torch CPU
tensors (vLLM's packed layout, Qwen3-8B geometry: 36 layers, 8 KV heads, head_dim 128, BF16, block 16) in
a shared-memory pages file, and the scheduler connector planning the load of a stored prefix. For each
mode, per round: ``start_load_kv`` returns (t_start), ``wait_for_layer_load(layer 0)`` returns (t_first),
the last layer's wait returns (t_all). Modes: ``sync`` (``orbitkv.async_load: false``), ``async`` (the
loader thread). With a Manager whose ``restore`` takes ``layers=``, ``async`` restores one layer per call.

Usage: python bench_async_load.py [--blocks 32] [--rounds 5] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

from orbitkv_fs.connectors.common import prefix_chunk_keys, supports_layer_restore
from orbitkv_fs.connectors.vllm import OrbitKVConnector
from orbitkv_fs.dataplane import DataPlaneServer
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.pages import HostPages, PageTensor

LAYERS, HEADS, HD, BS = 36, 8, 128, 16


def config(endpoint: str, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"orbitkv.manager": endpoint,
                                                                      **{f"orbitkv.{k}": v for k, v in extra.items()}},
                                           kv_load_failure_policy="recompute", engine_id="bench"),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(model="Qwen/Qwen3-8B", revision=None,
                                     hf_config=SimpleNamespace(num_hidden_layers=LAYERS)),
        parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    n_blocks = 2 * args.blocks + 2
    tmp = tempfile.mkdtemp(prefix="orbitkv-bench-")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    pages = HostPages.create([PageTensor(n, 0, [n_blocks, HEADS, BS, 2 * HD], [], "bfloat16", "kv", i, "vllm_packed")
                              for i, n in enumerate(names)], directory="/dev/shm")
    kv = {n: torch.from_numpy(pages.array(n).view(np.uint16)).view(torch.bfloat16) for n in names}
    rng = np.random.default_rng(0)
    for t in kv.values():
        t.view(torch.int16)[: args.blocks] = torch.from_numpy(
            rng.integers(-2**14, 2**14, size=(args.blocks, HEADS, BS, 2 * HD), dtype=np.int16))
    endpoint = f"ipc://{tmp}/dp.sock"
    manager = Manager(ManagerConfig(pool_size=(args.blocks * LAYERS * HEADS * BS * 2 * HD * 2) * 2 + (64 << 20),
                                    device="cpu"))
    server = DataPlaneServer(manager, endpoint, workers=2)
    prompt = list(range(1000, 1000 + args.blocks * BS + 1))
    keys = prefix_chunk_keys(prompt, BS, salt=b"Qwen/Qwen3-8B@")
    report = {"geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HD, "block_size": BS, "dtype": "bfloat16"},
              "blocks": args.blocks, "bytes_loaded": args.blocks * LAYERS * HEADS * BS * 2 * HD * 2,
              "rounds": args.rounds, "data_plane": "ipc", "modes": {}}
    try:
        for mode in ("sync", "async"):
            sched = OrbitKVConnector(config(endpoint), "scheduler", None)
            worker = OrbitKVConnector(config(endpoint, async_load=(mode == "async")), "worker", None)
            worker.register_kv_caches(kv)
            session = worker._session
            report["layered_restore"] = supports_layer_restore(session.client)
            res = session.client.save(session.engine_id, [ChunkBlocks(k, [b]) for b, k in enumerate(keys)])
            assert res.chunks_saved + res.chunks_present == args.blocks
            rows = []
            for r in range(args.rounds):
                rid = f"{mode}-{r}"
                dst = list(range(args.blocks, 2 * args.blocks + 1))
                req = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, block_hashes=[])
                n, _ = sched.get_num_new_matched_tokens(req, 0)
                assert n == args.blocks * BS, n
                sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda d=dst: (d,)), n)
                meta = sched.build_connector_meta(SimpleNamespace(
                    scheduled_new_reqs=[SimpleNamespace(req_id=rid, prompt_token_ids=prompt, block_ids=(dst,),
                                                        num_computed_tokens=n)],
                    scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                          num_computed_tokens=[]),
                    num_scheduled_tokens={rid: 1}))
                worker.bind_connector_metadata(meta)
                t0 = time.perf_counter()
                worker.start_load_kv(SimpleNamespace())
                t_start = time.perf_counter() - t0
                worker.wait_for_layer_load(names[0])
                t_first = time.perf_counter() - t0
                worker.wait_for_layer_load(names[-1])
                t_all = time.perf_counter() - t0
                worker.wait_for_save()
                assert worker.get_block_ids_with_load_errors() == set()
                worker.clear_connector_metadata()
                sched.request_finished(req, dst)
                for t in (kv[names[0]], kv[names[-1]]):
                    assert torch.equal(t[args.blocks: 2 * args.blocks].view(torch.int16),
                                       t[: args.blocks].view(torch.int16))
                    t.view(torch.int16)[args.blocks: 2 * args.blocks] = 0
                rows.append({"start_load_kv_ms": t_start * 1e3, "first_layer_ms": t_first * 1e3,
                             "all_layers_ms": t_all * 1e3})
            worker.shutdown()
            sched.shutdown()
            report["modes"][mode] = {
                "rounds": rows,
                "median": {k: statistics.median(r[k] for r in rows) for k in rows[0]}}
    finally:
        server.close()
        manager.close()
        kv.clear()
        pages.close()
    report["loadavg_1m"] = os.getloadavg()[0]
    report["python"] = sys.version.split()[0]
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({"layered_restore": report["layered_restore"],
                      **{m: v["median"] for m, v in report["modes"].items()}, "loadavg_1m": report["loadavg_1m"]}))


if __name__ == "__main__":
    main()
