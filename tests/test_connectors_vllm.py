"""The vLLM connector driven the way vLLM's scheduler and worker drive it, without vLLM (source-only).

vLLM's request, block and scheduler-output objects are stood in by plain records carrying exactly the
fields the connector reads (``test_connectors_upstream.py`` checks those fields exist in vLLM 0.33). The
Manager is real (embedded, or behind the real data plane); the worker's KV caches are real torch CPU
tensors named like vLLM's layers (``model.layers.N.self_attn.attn``) inside a shared-memory pages file, so
``register_kv_caches`` runs its real registration path (the file and offset stand in for the CUDA IPC
handle the GPU test uses).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from orbitkv_fs.client import EmbeddedClient, connect  # noqa: E402
from orbitkv_fs.connectors.common import PrefixPlanner, Transfer, layer_index, prefix_chunk_keys  # noqa: E402
from orbitkv_fs.connectors.vllm import OrbitKVConnector, OrbitKVConnectorMetadata  # noqa: E402
from orbitkv_fs.dataplane import DataPlaneServer  # noqa: E402
from orbitkv_fs.manager import SKIP_BLOCK, ChunkBlocks, Manager, ManagerConfig  # noqa: E402
from orbitkv_fs.pages import HostPages, PageTensor  # noqa: E402
from polling import wait_until

BS = 16
HEADS, HD, BLOCKS = 2, 32, 64
BLOCK_KV_BYTES = 2 * HEADS * BS * 2 * HD * 2  # one block of every layer (2), K and V, bf16


@dataclass
class Req:  # vllm.v1.request.Request, the fields we read
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class Blocks:  # vllm.v1.core.kv_cache_manager.KVCacheBlocks
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _new(req: Req, blocks: list[int], computed: int) -> SimpleNamespace:  # NewRequestData
    return SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, block_ids=(blocks,),
                           num_computed_tokens=computed)


def _output(new=(), cached=(), scheduled=None, resumed=(), vllm="0.33") -> SimpleNamespace:  # SchedulerOutput
    """vLLM's scheduler output. Up to 0.33 a preempted request resumes among the cached ones, named in
    ``resumed_req_ids``; from 0.34 it is re-sent in full as a new one and that field is gone."""
    cached = list(cached)
    data = SimpleNamespace(req_ids=[c[0] for c in cached], new_block_ids=[(c[1],) if c[1] else None for c in cached],
                           num_computed_tokens=[c[2] for c in cached])
    if vllm == "0.33":
        data.resumed_req_ids = set(resumed)
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=data,
                           num_scheduled_tokens=dict(scheduled or {}))


def _backend(name: str) -> SimpleNamespace:  # an attention layer of vLLM's static forward context
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name))


def _config(*, rank: int = 0, tp: int = 1, pp: int = 1, layers: int = 2, policy: str = "recompute",
            backend: str = "FLASH_ATTN", **extra) -> SimpleNamespace:
    """vLLM's config; ``extra`` are ``orbitkv.*`` settings (chunk_tokens: one block per chunk unless given,
    None for the connector's default); every layer ``model.layers.N.self_attn.attn`` uses ``backend``."""
    extra.setdefault("chunk_tokens", BS)
    extra = {k: v for k, v in extra.items() if v is not None}
    ctx = {f"model.layers.{i}.self_attn.attn": _backend(backend) for i in range(max(layers, 64))}
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=ctx),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={f"orbitkv.{k}": v for k, v in extra.items()},
                                           kv_load_failure_policy=policy),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(model="org/m", revision=None, hf_config=SimpleNamespace(num_hidden_layers=layers)),
        parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=tp, pipeline_parallel_size=pp))


class VllmPages:
    """A worker's paged KV caches: one ``[blocks, heads, BS, 2 * HD]`` BF16 torch tensor per layer, named as
    vLLM names them, living in a shared-memory pages file the Manager maps."""

    def __init__(self, layers: range, directory: str) -> None:
        self.layers = layers
        self.names = [f"model.layers.{i}.self_attn.attn" for i in layers]
        specs = [PageTensor(n, 0, [BLOCKS, HEADS, BS, 2 * HD], [], "bfloat16", "kv", i, "vllm_packed")
                 for n, i in zip(self.names, layers)]
        self.pages = HostPages.create(specs, directory=directory)
        self.kv = {n: torch.from_numpy(self.pages.array(n).view(np.uint16)).view(torch.bfloat16) for n in self.names}

    def fill(self, block: int, value: float) -> None:
        for t in self.kv.values():
            t[block, ..., :HD] = value
            t[block, ..., HD:] = -value

    def holds(self, block: int, value: float, layer: int | None = None) -> bool:
        ts = self.kv.values() if layer is None else [self.kv[f"model.layers.{layer}.self_attn.attn"]]
        return all(bool((t[block, ..., :HD].float() == value).all() and (t[block, ..., HD:].float() == -value).all())
                   for t in ts)

    def close(self) -> None:
        self.kv = {}
        self.pages.close()


@pytest.fixture
def manager(tmp_path):
    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    yield m
    m.close()


@pytest.fixture
def connectors(manager, tmp_path):
    """``make(client=None, layers=2, **extra)``: a scheduler connector and a worker connector of ``layers`` layers
    whose pages are registered through register_kv_caches, sharing ``client`` (default: embedded in the
    ``manager`` fixture); every worker is shut down and its pages closed after the test."""
    made: list[SimpleNamespace] = []

    def make(client=None, *, layers: int = 2, **extra) -> SimpleNamespace:
        client = client or connect(manager)
        kv = VllmPages(range(layers), str(tmp_path))
        sched, worker = (OrbitKVConnector(_config(layers=layers, **extra), role, None)
                         for role in ("scheduler", "worker"))
        sched._client = worker._client = client
        worker.register_kv_caches(kv.kv)
        assert worker._session is not None
        made.append(SimpleNamespace(manager=manager, client=client, kv=kv, sched=sched, worker=worker,
                                    engine_id=worker._session.engine_id))
        return made[-1]

    yield make
    for e in made:
        e.worker.shutdown()
        e.kv.close()


@pytest.fixture
def env(connectors):
    """:func:`connectors` ' pair of 2 layers (asynchronous loads, the default)."""
    e = connectors()
    assert e.worker._loader is not None
    return e


def _save_prefix(env, prompt: list[int], n_blocks: int) -> list[bytes]:
    keys = prefix_chunk_keys(prompt, BS, salt=b"org/m@")[:n_blocks]
    for b in range(n_blocks):
        env.kv.fill(b, float(b + 1))
    res = env.client.save(env.engine_id, [ChunkBlocks(k, [b]) for b, k in enumerate(keys)])
    assert res.chunks_saved == n_blocks
    return keys


def _plan_load(sched: OrbitKVConnector, req: Req, blocks: list[int], n_tokens: int) -> OrbitKVConnectorMetadata:
    assert sched.get_num_new_matched_tokens(req, 0) == (n_tokens, False)
    sched.update_state_after_alloc(req, Blocks(blocks), n_tokens)
    return sched.build_connector_meta(_output(new=[_new(req, blocks, n_tokens)], scheduled={req.request_id: 1}))


# ------------------------------------------------------------------------------------------ the full flow


def test_prompt_blocks_are_saved_once_and_a_later_request_loads_them(env) -> None:
    sched, worker, kv = env.sched, env.worker, env.kv
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    r1 = Req("r1", prompt)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, Blocks([]), 0)
    # Chunked prefill: 20 tokens, then the remaining 30.
    meta = sched.build_connector_meta(_output(new=[_new(r1, [3, 4], 0)], scheduled={"r1": 20}))
    assert isinstance(meta, OrbitKVConnectorMetadata) and not meta.loads
    assert [t.blocks for t in meta.saves] == [[[3]]]
    for b, v in ((3, 1.0), (4, 2.0), (5, 3.0), (6, 4.0)):
        kv.fill(b, v)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    meta = sched.build_connector_meta(_output(cached=[("r1", [5, 6], 20)], scheduled={"r1": 30}))
    assert [t.blocks for t in meta.saves] == [[[4], [5]]]  # blocks 1 and 2; block 3 (token 48..) is partial
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    assert sched.request_finished(r1, [3, 4, 5, 6]) == (False, None)

    # A second request with the same first 40 tokens: two blocks hit, the engine computes the rest.
    r2 = Req("r2", prompt[:40] + [7] * 9)
    assert sched.get_num_new_matched_tokens(r2, 0) == (32, False)
    assert sched.get_num_new_matched_tokens(r2, 16) == (16, False)  # vLLM's own prefix cache had block 0
    sched.get_num_new_matched_tokens(r2, 0)
    sched.update_state_after_alloc(r2, Blocks([10, 11, 12, 13]), 32)
    meta = sched.build_connector_meta(_output(new=[_new(r2, [10, 11, 12, 13], 32)], scheduled={"r2": 17}))
    assert [(t.keys, t.blocks) for t in meta.loads] == [(prefix_chunk_keys(prompt, BS, salt=b"org/m@")[:2],
                                                         [[10], [11]])]
    # Loaded blocks are not saved again; block 2 (tokens 32..47, computed this step) is new and full.
    assert [t.blocks for t in meta.saves] == [[[12]]]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    for name in kv.names:
        worker.wait_for_layer_load(name)
    assert kv.holds(10, 1.0) and kv.holds(11, 2.0)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_block_that_fails_to_load_is_reported_with_everything_after_it(env) -> None:
    prompt = list(range(7, 7 + 64))
    keys = _save_prefix(env, prompt, 4)
    meta = _plan_load(env.sched, Req("r", prompt + [1]), [20, 21, 22, 23, 24], 64)
    # Between lookup and load the third block disappears (evicted, or a corrupt record).
    env.client.invalidate(chunks=[keys[2]], engine_id=env.engine_id)
    env.worker.bind_connector_metadata(meta)
    env.worker.start_load_kv(SimpleNamespace())
    env.worker.wait_for_layer_load(env.kv.names[0])
    # vLLM asks for load errors before wait_for_save when it defers finalisation: the load must be waited for.
    assert env.worker.get_block_ids_with_load_errors() == {22, 23}
    assert env.worker.get_block_ids_with_load_errors() == set()  # reported once
    assert env.kv.holds(20, 1.0) and env.kv.holds(21, 2.0)


def test_an_unreachable_manager_means_no_hits_and_no_errors(tmp_path) -> None:
    dead = f"ipc://{tmp_path}/nobody.sock"
    sched = OrbitKVConnector(_config(manager=dead, cooldown_s=60, lookup_timeout_s=0.3), "scheduler", None)
    r = Req("r", list(range(64)))
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert time.monotonic() - t0 < 5  # the scheduler's lookup timeout, not the 30 s data timeout
    assert sched._guard.stats.failures == 1 and sched._guard.stats.skipped >= 1
    worker = OrbitKVConnector(_config(manager=dead, timeout_s=0.3), "worker", None)
    meta = OrbitKVConnectorMetadata(loads=sched.build_connector_meta(_output()).loads)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    worker.wait_for_save()
    assert worker.get_finished({"r"}) == (None, None)


def test_block_hash_keys_option(env) -> None:
    sched = OrbitKVConnector(_config(key_source="block_hashes"), "scheduler", None)
    sched._client = env.client
    r = Req("r", list(range(40)), block_hashes=[b"h0", b"h1"])
    assert sched._keys_for(r) != prefix_chunk_keys(r.prompt_token_ids, BS, salt=b"org/m@")
    assert len(sched._keys_for(r)) == 2
    with pytest.raises(ValueError, match="key_source"):
        OrbitKVConnector(_config(key_source="nope"), "scheduler", None)


def _run_step(env, meta: OrbitKVConnectorMetadata) -> set[int]:
    """The worker's part of one step: loads (every layer waited for), then saves; the failed blocks."""
    env.worker.bind_connector_metadata(meta)
    env.worker.start_load_kv(SimpleNamespace())
    for name in env.kv.names:
        env.worker.wait_for_layer_load(name)
    env.worker.wait_for_save()
    return env.worker.get_block_ids_with_load_errors()


def test_chunks_of_several_blocks_load_around_the_engine_s_own_blocks(connectors) -> None:
    """Four blocks per chunk (64 tokens). A prompt's full chunks are saved as they complete; a later
    request whose vLLM prefix cache holds 5 blocks loads blocks 5-11 only: the chunk it holds in part is
    restored with SKIP_BLOCK at its shared block, which keeps what it held. A prompt that ends on a chunk
    boundary loads all but its last block; a chunk the engine holds in part and the store lacks is saved
    once the request computed the rest, shared block included."""
    env = connectors(chunk_tokens=4 * BS)
    sched, kv, S = env.sched, env.kv, SKIP_BLOCK
    assert sched._planner.chunk_blocks == 4
    prompt = list(range(1000, 1200))  # 200 tokens: 12 full blocks, 3 full chunks
    keys = prefix_chunk_keys(prompt, 4 * BS, salt=b"org/m@")
    r1, own = Req("r1", prompt), list(range(13))
    for b in own:
        kv.fill(b, float(b + 1))
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, Blocks([]), 0)
    meta = sched.build_connector_meta(_output(new=[_new(r1, own[:7], 0)], scheduled={"r1": 100}))
    assert not meta.loads and [(t.keys, t.blocks) for t in meta.saves] == [(keys[:1], [own[0:4]])]
    assert _run_step(env, meta) == set()
    meta = sched.build_connector_meta(_output(cached=[("r1", own[7:], 100)], scheduled={"r1": 100}))
    assert [(t.keys, t.blocks) for t in meta.saves] == [(keys[1:3], [own[4:8], own[8:12]])]
    assert _run_step(env, meta) == set()
    sched.request_finished(r1, own)

    # r2: the same 200 tokens and more; vLLM's own cache has blocks 0-4 (shared with r1), 5-14 are new.
    r2 = Req("r2", prompt + [5] * 40)
    shared, new = own[:5], list(range(30, 40))
    kv.fill(4, 99.0)  # a write into the shared block would show
    assert sched.get_num_new_matched_tokens(r2, 80) == (112, False)  # 3 chunks hit: blocks 5-11
    sched.update_state_after_alloc(r2, Blocks(shared + new), 112)
    meta = sched.build_connector_meta(_output(new=[_new(r2, shared + new, 192)], scheduled={"r2": 48}))
    assert [(t.keys, t.blocks) for t in meta.loads] == [(keys[1:3], [[S] + new[0:3], new[3:7]])]
    assert not meta.saves  # chunk 3 is not full yet (prompt of 240 tokens: 3 full chunks)
    assert _run_step(env, meta) == set()
    assert kv.holds(4, 99.0)
    assert all(kv.holds(b, float(p + 1)) for p, b in zip(range(5, 12), new))
    sched.request_finished(r2, shared + new)

    # r3: the first 192 tokens, nothing local: it must compute its last token, so the last position of
    # chunk 2 is not loaded (block 51 is left for the engine).
    r3, blocks3 = Req("r3", prompt[:192]), list(range(40, 52))
    kv.fill(51, 7.0)
    assert sched.get_num_new_matched_tokens(r3, 0) == (176, False)
    sched.update_state_after_alloc(r3, Blocks(blocks3), 176)
    meta = sched.build_connector_meta(_output(new=[_new(r3, blocks3, 176)], scheduled={"r3": 16}))
    assert [t.blocks for t in meta.loads] == [[blocks3[0:4], blocks3[4:8], blocks3[8:11] + [S]]]
    assert not meta.saves
    assert _run_step(env, meta) == set()
    assert all(kv.holds(b, float(p + 1)) for p, b in enumerate(blocks3[:11])) and kv.holds(51, 7.0)
    sched.request_finished(r3, blocks3)

    # r4: another prompt whose first chunk only is stored; vLLM holds 5 blocks of it: no load, and chunk 1
    # (blocks 4-7: one shared, three computed now) is saved once complete. Without a load the planner does
    # not know what the store holds: chunk 0 is offered again, and the Manager finds it present.
    other = list(range(3000, 3140))  # 140 tokens: 2 full chunks
    okeys = prefix_chunk_keys(other, 4 * BS, salt=b"org/m@")
    env.client.save(env.engine_id, [ChunkBlocks(okeys[0], [20, 21, 22, 23])])
    r4, blocks4 = Req("r4", other), [20, 21, 22, 23, 24, 25, 26, 27, 28]
    assert sched.get_num_new_matched_tokens(r4, 80) == (0, False)
    sched.update_state_after_alloc(r4, Blocks(blocks4), 0)
    meta = sched.build_connector_meta(_output(new=[_new(r4, blocks4, 80)], scheduled={"r4": 60}))
    assert not meta.loads and [(t.keys, t.blocks) for t in meta.saves] == [(okeys, [blocks4[0:4], blocks4[4:8]])]
    saved = env.manager.stats().save_logical_bytes
    assert _run_step(env, meta) == set()
    assert env.manager.stats().save_logical_bytes - saved == 4 * BLOCK_KV_BYTES  # chunk 1 only
    assert env.client.lookup(env.engine_id, okeys, lease=False).count == 2


def test_a_multi_block_chunk_that_fails_to_load_reports_only_blocks_it_would_write(connectors) -> None:
    env = connectors(chunk_tokens=4 * BS)
    prompt = list(range(500, 700))
    keys = prefix_chunk_keys(prompt, 4 * BS, salt=b"org/m@")
    env.client.save(env.engine_id, [ChunkBlocks(k, list(range(4 * c, 4 * c + 4))) for c, k in enumerate(keys)])
    r = Req("r", prompt + [1])
    blocks = list(range(40, 53))
    assert env.sched.get_num_new_matched_tokens(r, 32) == (160, False)  # vLLM holds blocks 0-1
    env.sched.update_state_after_alloc(r, Blocks(blocks), 160)
    meta = env.sched.build_connector_meta(_output(new=[_new(r, blocks, 192)], scheduled={"r": 9}))
    env.client.invalidate(chunks=[keys[0]], engine_id=env.engine_id)
    # chunk 0's positions 2-3 and everything after them; never the skipped (shared) blocks 40-41
    assert _run_step(env, meta) == set(blocks[2:12])


def test_chunk_tokens_default_and_validation() -> None:
    assert OrbitKVConnector(_config(chunk_tokens=None), "scheduler", None)._planner.chunk_blocks == 256 // BS
    assert OrbitKVConnector(_config(chunk_tokens=2 * BS), "scheduler", None)._planner.chunk_blocks == 2
    for bad in (0, BS + 1, -BS):
        with pytest.raises(ValueError, match="chunk_tokens"):
            OrbitKVConnector(_config(chunk_tokens=bad), "scheduler", None)
    sched = OrbitKVConnector(_config(chunk_tokens=2 * BS, key_source="block_hashes"), "scheduler", None)
    hashes = [b"h%d" % i for i in range(5)]
    one = OrbitKVConnector(_config(key_source="block_hashes"), "scheduler", None)
    two = sched._keys_for(Req("r", list(range(80)), block_hashes=hashes))
    assert len(two) == 2 and not set(two) & set(one._keys_for(Req("q", list(range(80)), block_hashes=hashes)))


def test_planner_without_a_load_saves_only_chunks_the_engine_lacks() -> None:
    """Told that the engine holds 5 blocks and loads nothing, a planner of 4-block chunks saves chunk 1 (held
    in part) once complete, never chunk 0 (held in full)."""
    p = PrefixPlanner(BS, 4)
    keys = [bytes([i]) * 16 for i in range(3)]
    p.matched("r", keys, 200, 5 * BS, 0)
    p.allocated("r", list(range(13)), 0)
    p.scheduled("r", 120, replace_blocks=False)  # blocks 0-6 done: chunk 1 not complete yet
    assert p.take() == ([], [])
    p.scheduled("r", 200)
    loads, saves = p.take()
    assert not loads and [(s.keys, s.blocks) for s in saves] == [(keys[1:3], [[4, 5, 6, 7], [8, 9, 10, 11]])]


def test_planner_preemption_replaces_blocks() -> None:
    p = PrefixPlanner(BS)
    keys = [bytes([i]) * 16 for i in range(3)]
    p.matched("r", keys, 50, 0, 0)
    p.scheduled("r", 16, [1])
    p.scheduled("r", 50, [7, 8, 9], replace_blocks=True)  # resumed after preemption: new block table
    loads, saves = p.take()
    assert not loads and [s.blocks for s in saves] == [[[1]], [[8], [9]]]
    p.finished("r")
    assert not p.known("r")
    p.scheduled("r", 50, [1, 2, 3])  # unknown request: nothing planned
    assert p.take() == ([], [])


@pytest.mark.parametrize("vllm", ["0.33", "0.34"])
def test_a_preempted_request_resumes_on_its_new_block_table_in_either_vllm(env, vllm) -> None:
    """A request preempted after its first chunk resumes on a new block table: up to vLLM 0.33 among the
    running requests, named in ``resumed_req_ids``; from 0.34 as a new request (the field is gone). Either
    way the chunks still to save are saved from the new blocks, while another running request goes on."""
    sched = env.sched
    r0, r1 = Req("r0", list(range(500, 520))), Req("r1", list(range(100, 150)))
    for r in (r0, r1):
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        sched.update_state_after_alloc(r, Blocks([]), 0)
    meta = sched.build_connector_meta(_output(new=[_new(r0, [1, 2], 0), _new(r1, [3, 4], 0)],
                                              scheduled={"r0": 4, "r1": 20}, vllm=vllm))
    assert [t.blocks for t in meta.saves] == [[[3]]]
    # r1 preempted (its blocks freed), then resumed from token 0 on blocks 7..10, while r0 runs on.
    if vllm == "0.33":
        out = _output(cached=[("r0", [], 4), ("r1", [7, 8, 9, 10], 0)], scheduled={"r0": 1, "r1": 50},
                      resumed=["r1"], vllm=vllm)
    else:
        out = _output(new=[_new(r1, [7, 8, 9, 10], 0)], cached=[("r0", [], 4)], scheduled={"r0": 1, "r1": 50},
                      vllm=vllm)
    meta = sched.build_connector_meta(out)
    assert [t.blocks for t in meta.saves] == [[[8], [9]]]  # blocks 1 and 2 of r1, from its new table


def test_worker_shutdown_unregisters_its_engine(env) -> None:
    assert [e.engine_id for e in env.manager.list_engines()] == [env.engine_id]
    env.sched.shutdown()  # the scheduler owns no registration
    assert len(env.manager.list_engines()) == 1
    env.worker.shutdown()
    assert env.manager.list_engines() == []


# ------------------------------------------------------------------------------------ asynchronous loads


class GatedClient(EmbeddedClient):
    """The real embedded client whose restores each wait for a permit (a slow tier, one restore at a
    time), recording each call's ``layers``. The restore underneath writes every layer (the Manager's
    filter is the Manager's to test), so what this checks is the connector's order and its per-layer waits."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(manager)
        self.permits = threading.Semaphore(0)
        self.calls: list[list[int] | None] = []
        self.returned: list[list[int] | None] = []

    def allow(self, n: int = 1) -> None:
        self.permits.release(n)

    def restore(self, engine_id, chunks, *, lease_id=0, layers=None):  # type: ignore[override]
        self.calls.append(layers)
        assert self.permits.acquire(timeout=30)
        res = super().restore(engine_id, chunks)
        self.returned.append(layers)
        return res


def _waiter(worker: OrbitKVConnector, name: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        worker.wait_for_layer_load(name)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_start_load_kv_returns_before_the_restore_and_layers_wait(manager, connectors) -> None:
    client = GatedClient(manager)
    env = connectors(client)
    sched, worker, kv = env.sched, env.worker, env.kv
    prompt = list(range(1000, 1049))
    _save_prefix(env, prompt, 3)
    meta = _plan_load(sched, Req("r", prompt), [30, 31, 32, 33], 48)
    worker.bind_connector_metadata(meta)
    t0 = time.monotonic()
    worker.start_load_kv(SimpleNamespace())
    assert time.monotonic() - t0 < 1.0  # started, not done: the restore waits for its permit
    t, done = _waiter(worker, kv.names[0])
    assert not done.wait(0.3)  # a layer's wait blocks while its restore is in flight
    assert client.calls == [[0]] and client.returned == []  # layer 0's restore, waiting for its permit
    client.allow(2)  # layer 0, then layer 1
    assert done.wait(10)
    t.join()
    assert kv.holds(30, 1.0) and kv.holds(32, 3.0)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()


def test_layered_restores_run_in_layer_order_and_each_wait_needs_only_its_layer(manager, connectors) -> None:
    client = GatedClient(manager)
    env = connectors(client, layers=3)
    sched, worker, kv = env.sched, env.worker, env.kv
    prompt = list(range(2000, 2033))
    _save_prefix(env, prompt, 2)
    meta = _plan_load(sched, Req("r", prompt), [40, 41, 42], 32)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    first, first_done = _waiter(worker, kv.names[0])
    second, second_done = _waiter(worker, kv.names[1])
    assert wait_until(lambda: client.calls == [[0]])  # layer 0 first
    assert not first_done.wait(0.2)
    client.allow()  # layer 0 lands; layer 1's restore is now in flight
    assert first_done.wait(10)
    assert wait_until(lambda: client.calls == [[0], [1]])
    assert not second_done.wait(0.2) and client.returned == [[0]]
    client.allow(2)
    assert second_done.wait(10)
    first.join()
    second.join()
    worker.wait_for_save()
    assert client.returned == [[0], [1], [2]]
    assert worker.get_block_ids_with_load_errors() == set()
    assert kv.holds(40, 1.0) and kv.holds(41, 2.0)


def test_a_layered_load_stops_restoring_a_chunk_after_its_first_miss(manager, connectors) -> None:
    client = GatedClient(manager)
    env = connectors(client)
    client.allow(100)
    sched, worker, kv = env.sched, env.worker, env.kv
    prompt = list(range(3000, 3049))
    keys = _save_prefix(env, prompt, 3)
    meta = _plan_load(sched, Req("r", prompt), [50, 51, 52, 53], 48)
    client.invalidate(chunks=[keys[1]], engine_id=env.engine_id)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == {51, 52}
    assert client.calls == [[0], [1]]
    assert kv.holds(50, 1.0)


def test_async_load_off_loads_inside_start_load_kv_and_keeps_full_cuda_graphs(env, tmp_path) -> None:
    assert OrbitKVConnector.requires_piecewise_for_cudagraph({})
    assert not OrbitKVConnector.requires_piecewise_for_cudagraph({"orbitkv.async_load": False})
    assert not OrbitKVConnector.requires_piecewise_for_cudagraph({"orbitkv.async_load": "false"})
    worker = OrbitKVConnector(_config(async_load=False), "worker", None)
    worker._client = env.client
    kv = VllmPages(range(2), str(tmp_path))
    worker._worker_engine_id += "-sync"
    worker.register_kv_caches(kv.kv)
    try:
        assert worker._loader is None
        prompt = list(range(500, 549))
        _save_prefix(env, prompt, 3)
        meta = _plan_load(env.sched, Req("s", prompt), [7, 8, 9, 10], 48)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(SimpleNamespace())
        assert worker._load_job.finished  # done before the forward pass starts
        assert kv.holds(7, 1.0) and kv.holds(9, 3.0)
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
        kv.close()


# ------------------------------------------------------------------------------------- pipeline parallel


def test_layer_index_follows_vllm_names() -> None:
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("language_model.model.layers.3.self_attn.attn") == 3
    assert layer_index("L0") is None and layer_index("a.1.b.2") is None


def test_pp_rank_1_registers_its_global_layers_and_the_scheduler_looks_up_every_stage(manager, tmp_path) -> None:
    client = connect(manager)
    stages = [VllmPages(range(0, 2), str(tmp_path)), VllmPages(range(2, 4), str(tmp_path))]
    workers = [OrbitKVConnector(_config(rank=r, pp=2, layers=4), "worker", None) for r in (0, 1)]
    sched = OrbitKVConnector(_config(pp=2, layers=4), "scheduler", None)
    for c in (*workers, sched):
        c._client = client
    try:
        for w, kv in zip(workers, stages):
            w.register_kv_caches(kv.kv)
        assert [w._pp_rank for w in workers] == [0, 1]
        info = manager.get_engine(workers[1]._session.engine_id)
        assert (info.layer_start, info.layer_end, info.registration.num_layers) == (2, 4, 4)
        assert sorted(d.layer for d in info.registration.tensors) == [2, 3]
        assert workers[1]._layer_of == {"model.layers.2.self_attn.attn": 2, "model.layers.3.self_attn.attn": 3}
        assert workers[1]._load_groups() == [[2], [3]]  # the Manager restores single layers

        prompt = list(range(4000, 4049))
        keys = prefix_chunk_keys(prompt, BS, salt=b"org/m@")
        # Stage 0 saved 3 blocks, stage 1 only 2: the scheduler may load only what both stages hold.
        for w, kv, n in zip(workers, stages, (3, 2)):
            for b in range(n):
                kv.fill(b, float(b + 1))
            assert client.save(w._session.engine_id, [ChunkBlocks(k, [b]) for b, k in enumerate(keys[:n])]).chunks_saved == n
        meta = _plan_load(sched, Req("r", prompt), [60, 61, 62, 63], 32)
        for w, kv in zip(workers, stages):
            w.bind_connector_metadata(meta)
            w.start_load_kv(SimpleNamespace())
            w.wait_for_layer_load(kv.names[-1])
            w.wait_for_save()
            assert w.get_block_ids_with_load_errors() == set()
            assert kv.holds(60, 1.0) and kv.holds(61, 2.0)
    finally:
        for w in workers:
            w.shutdown()
        for kv in stages:
            kv.close()


def test_a_stage_registered_elsewhere_does_not_hide_hits(manager, tmp_path) -> None:
    """PP across hosts: stage 1 registered with its own host's Manager; this Manager knows stage 0 only."""
    client = connect(manager)
    kv = VllmPages(range(0, 2), str(tmp_path))
    worker = OrbitKVConnector(_config(rank=0, pp=2, layers=4), "worker", None)
    sched = OrbitKVConnector(_config(pp=2, layers=4), "scheduler", None)
    worker._client = sched._client = client
    worker.register_kv_caches(kv.kv)
    try:
        env = SimpleNamespace(client=client, kv=kv, engine_id=worker._session.engine_id)
        prompt = list(range(5000, 5049))
        _save_prefix(env, prompt, 3)
        assert sched.get_num_new_matched_tokens(Req("r", prompt), 0) == (48, False)
        assert sched._guard.stats.failures == 0
    finally:
        worker.shutdown()
        kv.close()


def test_rank_layout_is_dp_pp_tp() -> None:
    c = OrbitKVConnector(_config(rank=7, tp=2, pp=2), "worker", None)  # DP rank 1, PP rank 1, TP rank 1
    assert (c._tp_rank, c._pp_rank) == (1, 1)


def test_a_gap_in_a_stage_s_layers_disables_the_worker(manager, tmp_path) -> None:
    kv = VllmPages(range(0, 4), str(tmp_path))
    worker = OrbitKVConnector(_config(pp=2, layers=8), "worker", None)
    worker._client = connect(manager)
    try:
        worker.register_kv_caches({n: t for i, (n, t) in enumerate(kv.kv.items()) if i != 2})
        assert worker._session is None and manager.list_engines() == []
    finally:
        worker.shutdown()
        kv.close()


# ----------------------------------------------------------------------------------- operator failures


def test_engine_ids_are_per_instance_and_per_dp_rank() -> None:
    a, b = _config(), _config()
    a.kv_transfer_config.engine_id = "3f0c5e1c-aaaa-bbbb"
    b.kv_transfer_config.engine_id = "77d1e0aa-cccc-dddd"
    ids = {OrbitKVConnector(c, "worker", None)._worker_engine_id for c in (a, b)}
    assert len(ids) == 2  # two vLLM servers of one model on one host
    a.parallel_config.data_parallel_size, a.parallel_config.data_parallel_rank = 2, 1
    assert OrbitKVConnector(a, "worker", None)._worker_engine_id.endswith("-dp1-tp0-pp0")


def test_fail_policy_warns_the_operator(caplog) -> None:
    with caplog.at_level("WARNING"):
        OrbitKVConnector(_config(policy="fail"), "scheduler", None)
    assert "kv_load_failure_policy" in caplog.text


def test_several_kv_cache_groups_disable_the_connector(manager, tmp_path) -> None:
    groups = SimpleNamespace(kv_cache_groups=[object(), object()])
    sched = OrbitKVConnector(_config(), "scheduler", groups)
    worker = OrbitKVConnector(_config(), "worker", groups)
    sched._client = worker._client = connect(manager)
    kv = VllmPages(range(2), str(tmp_path))
    try:
        worker.register_kv_caches(kv.kv)
        assert worker._session is None and manager.list_engines() == []
        assert sched.get_num_new_matched_tokens(Req("r", list(range(64))), 0) == (0, False)
    finally:
        kv.close()


def test_a_restarted_manager_gets_the_worker_registered_again(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/dp.sock"
    m1 = Manager(ManagerConfig(pool_size=16 << 20, device="cpu", shm_dir=str(tmp_path)))
    srv = DataPlaneServer(m1, endpoint, workers=2)
    kv = VllmPages(range(2), str(tmp_path))
    worker = OrbitKVConnector(_config(manager=endpoint, timeout_s=2, cooldown_s=0.2), "worker", None)
    sched = OrbitKVConnector(_config(manager=endpoint, timeout_s=2, cooldown_s=0.2), "scheduler", None)
    m2 = srv2 = None
    try:
        worker.register_kv_caches(kv.kv)
        engine_id = worker._session.engine_id
        assert [e.engine_id for e in m1.list_engines()] == [engine_id]
        srv.close()
        m1.close()
        m2 = Manager(ManagerConfig(pool_size=16 << 20, device="cpu", shm_dir=str(tmp_path)))
        srv2 = DataPlaneServer(m2, endpoint, workers=2)
        # The first prefill after the restart: the save finds the engine unknown, registers and saves.
        prompt = list(range(6000, 6033))
        r = Req("r", prompt)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        sched.update_state_after_alloc(r, Blocks([]), 0)
        meta = sched.build_connector_meta(_output(new=[_new(r, [1, 2, 3], 0)], scheduled={"r": 33}))
        kv.fill(1, 5.0)
        kv.fill(2, 6.0)
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        if worker._session.reregistrations == 0:
            # The old connection broke with the old process: that save was lost (a miss, later recomputed).
            assert worker._guard.stats.failures == 1 and "connection" in worker._guard.stats.last_error
            time.sleep(0.3)
            worker.wait_for_save()  # the same saves, as the next prefill step would issue them
        assert worker._session.reregistrations == 1
        assert [e.engine_id for e in m2.list_engines()] == [engine_id]
        time.sleep(0.3)  # the scheduler's cool-down after it met the unknown engine, if it did
        assert sched.get_num_new_matched_tokens(Req("r2", prompt), 0) == (32, False)
    finally:
        worker.shutdown()
        sched.shutdown()
        for s in (srv2,):
            if s is not None:
                s.close()
        if m2 is not None:
            m2.close()
        kv.close()


def test_a_waiting_request_s_keys_are_derived_once(env) -> None:
    """vLLM asks again on every step a request waits for memory; its prompt's keys do not change."""
    r = Req("w", list(range(7000, 7000 + 4096)))
    env.sched.get_num_new_matched_tokens(r, 0)
    keys = env.sched._planner.keys("w")
    assert keys == prefix_chunk_keys(r.prompt_token_ids, BS, salt=b"org/m@")
    env.sched.get_num_new_matched_tokens(r, 0)
    assert env.sched._planner.keys("w") is keys
    env.sched.request_finished(r, [])
    assert env.sched._planner.keys("w") is None


def test_without_pipeline_stages_unnumbered_layers_are_numbered_in_order(manager, tmp_path) -> None:
    """One stage needs no global numbering: names without one index (an encoder-decoder's two attentions
    per layer) are registered in the model's order."""
    kv = VllmPages(range(2), str(tmp_path))
    config = _config()
    names = ["model.layers.0.self_attn.attn", "model.layers.0.cross_attn.attn"]
    config.compilation_config.static_forward_context[names[1]] = _backend("FLASH_ATTN")
    worker = OrbitKVConnector(config, "worker", None)
    worker._client = connect(manager)
    try:
        worker.register_kv_caches(dict(zip(names, kv.kv.values())))
        assert worker._layer_of == {names[0]: 0, names[1]: 1}
        assert manager.get_engine(worker._session.engine_id).layer_end == 2
    finally:
        worker.shutdown()
        kv.close()


def test_a_worker_started_before_its_manager_registers_once_the_manager_is_up(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/dp.sock"
    kv = VllmPages(range(2), str(tmp_path))
    worker = OrbitKVConnector(_config(manager=endpoint, timeout_s=2, cooldown_s=0.2), "worker", None)
    m = srv = None
    try:
        t0 = time.monotonic()
        worker.register_kv_caches(kv.kv)
        assert time.monotonic() - t0 < 4  # the connect timeout, not a call timeout per attempt
        assert worker._session is None and worker._registration is not None
        m = Manager(ManagerConfig(pool_size=16 << 20, device="cpu", shm_dir=str(tmp_path)))
        srv = DataPlaneServer(m, endpoint, workers=2)
        time.sleep(0.3)  # the cool-down after the failed start
        keys = prefix_chunk_keys(list(range(8000, 8033)), BS, salt=b"org/m@")
        kv.fill(1, 9.0)
        worker.bind_connector_metadata(OrbitKVConnectorMetadata(saves=[Transfer("r", keys[:1], [[1]])]))
        worker.wait_for_save()
        assert worker._session is not None
        assert [e.engine_id for e in m.list_engines()] == [worker._session.engine_id]
        assert m.lookup(worker._session.engine_id, keys[:1], lease=False).count == 1
    finally:
        worker.shutdown()
        if srv is not None:
            srv.close()
        if m is not None:
            m.close()
        kv.close()


def test_shutdown_during_a_load_waits_for_it_then_unregisters(manager, connectors) -> None:
    """The Manager is writing into the worker's pages: shutdown must not unregister (and let the pages go)
    before that write ended."""
    client = GatedClient(manager)
    env = connectors(client)
    sched, worker, kv = env.sched, env.worker, env.kv
    prompt = list(range(9000, 9033))
    _save_prefix(env, prompt, 2)
    worker.bind_connector_metadata(_plan_load(sched, Req("r", prompt), [5, 6, 7], 32))
    worker.start_load_kv(SimpleNamespace())
    assert wait_until(lambda: client.calls == [[0]])
    t = threading.Thread(target=worker.shutdown)
    t.start()
    t.join(0.3)
    assert t.is_alive() and [e.engine_id for e in manager.list_engines()] == [env.engine_id]
    client.allow(2)  # layer 0, then layer 1
    t.join(10)
    assert not t.is_alive() and manager.list_engines() == []
    assert kv.holds(5, 1.0) and kv.holds(6, 2.0)


def test_many_steps_of_loads_saves_and_misses_leave_no_reservations(tmp_path) -> None:
    """Over the real data plane: requests load, miss, save and finish across steps; afterwards the Manager
    holds no lease, reservation or in-flight request for them."""
    endpoint = f"ipc://{tmp_path}/dp.sock"
    m = Manager(ManagerConfig(pool_size=32 << 20, device="cpu", shm_dir=str(tmp_path)))
    srv = DataPlaneServer(m, endpoint, workers=2)
    kv = VllmPages(range(2), str(tmp_path))
    sched = OrbitKVConnector(_config(manager=endpoint), "scheduler", None)
    worker = OrbitKVConnector(_config(manager=endpoint), "worker", None)
    try:
        worker.register_kv_caches(kv.kv)
        engine_id = worker._session.engine_id
        prompts = [list(range(100 * i, 100 * i + 49)) for i in range(6)]
        for i, p in enumerate(prompts):  # cold: each prompt computed and saved
            r = Req(f"c{i}", p)
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sched.update_state_after_alloc(r, Blocks([]), 0)
            blocks = [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]
            for j, b in enumerate(blocks[:3]):
                kv.fill(b, float(10 * i + j))
            worker.bind_connector_metadata(sched.build_connector_meta(_output(new=[_new(r, blocks, 0)],
                                                                              scheduled={r.request_id: 49})))
            worker.start_load_kv(SimpleNamespace())
            worker.wait_for_save()
            assert worker.get_block_ids_with_load_errors() == set()
            worker.clear_connector_metadata()
            sched.request_finished(r, blocks)
        # Evict one prompt's middle block; then every prompt again, two per step, into fresh blocks.
        m.invalidate(chunks=[prefix_chunk_keys(prompts[3], BS, salt=b"org/m@")[1]], engine_id=engine_id)
        for step in range(3):
            reqs = [Req(f"w{2 * step + k}", prompts[2 * step + k]) for k in range(2)]
            new, errors = [], set()
            for k, r in enumerate(reqs):
                n, _ = sched.get_num_new_matched_tokens(r, 0)
                blocks = [40 + 8 * step + 4 * k + j for j in range(4)]
                sched.update_state_after_alloc(r, Blocks(blocks), n)
                new.append(_new(r, blocks, n))
            meta = sched.build_connector_meta(_output(new=new, scheduled={r.request_id: 1 for r in reqs}))
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(SimpleNamespace())
            for name in kv.names:
                worker.wait_for_layer_load(name)
            worker.wait_for_save()
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            for k, r in enumerate(reqs):
                i = 2 * step + k
                base = 40 + 8 * step + 4 * k
                if i == 3:  # its lookup stopped at the hole: one block loaded, nothing failed
                    assert kv.holds(base, 30.0) and errors == set()
                else:
                    assert all(kv.holds(base + j, float(10 * i + j)) for j in range(3))
                sched.request_finished(r, [])
        st = m.stats()
        assert (st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.reserved_bytes, st.inflight_requests) == (0, 0, 0, 0, 0)
    finally:
        worker.shutdown()
        sched.shutdown()
        srv.close()
        m.close()
        kv.close()
