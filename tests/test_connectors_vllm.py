"""The vLLM connector driven the way vLLM's scheduler and worker drive it, without vLLM (source-only).

vLLM's request, block and scheduler-output objects are stood in by plain records carrying exactly the
fields the connector reads (``test_connectors_upstream.py`` checks those fields exist in vLLM 0.33). The
Manager is real (embedded); the "worker" registers host pages in place of CUDA IPC tensors, which the
GPU test does for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from orbitkv_fs.client import connect
from orbitkv_fs.connectors.common import EngineSession, PrefixPlanner, StagingPages, prefix_chunk_keys
from orbitkv_fs.connectors.vllm import OrbitKVConnector, OrbitKVConnectorMetadata
from orbitkv_fs.manager import Manager, ManagerConfig

BS = 16


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


def _output(new=(), cached=(), scheduled=None) -> SimpleNamespace:  # SchedulerOutput
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                                              new_block_ids=[(c[1],) if c[1] else None for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(scheduled or {}))


def _config(**extra) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={f"orbitkv.{k}": v for k, v in extra.items()}),
        cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="org/m", revision=None),
        parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))


@pytest.fixture
def env(tmp_path):
    """A Manager, a registered 'worker' engine (host pages, 64 blocks), a scheduler and a worker connector."""
    manager = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    client = connect(manager)
    pages = StagingPages(num_layers=2, slots=64, block_size=BS, num_heads=2, head_dim=32, dtype="bfloat16",
                         directory=str(tmp_path))
    sched = OrbitKVConnector(_config(), "scheduler", None)
    worker = OrbitKVConnector(_config(), "worker", None)
    info = client.register(pages.registration(model="org/m@", engine_kind="vllm",
                                              engine_id=sched._scheduler_engine_id))
    for c in (sched, worker):
        c._client = client
    worker._session = EngineSession(client, info.engine_id, guard=worker._guard)
    yield SimpleNamespace(manager=manager, client=client, pages=pages, sched=sched, worker=worker, info=info)
    pages.close()
    manager.close()


def _fill(pages: StagingPages, block: int, value: float) -> None:
    for layer in range(pages.num_layers):
        pages.key(layer)[block] = value
        pages.value(layer)[block] = -value


def test_prompt_blocks_are_saved_once_and_a_later_request_loads_them(env) -> None:
    sched, worker, pages = env.sched, env.worker, env.pages
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    r1 = Req("r1", prompt)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, Blocks([]), 0)
    # Chunked prefill: 20 tokens, then the remaining 30.
    meta = sched.build_connector_meta(_output(new=[_new(r1, [3, 4], 0)], scheduled={"r1": 20}))
    assert isinstance(meta, OrbitKVConnectorMetadata) and not meta.loads
    assert [t.blocks for t in meta.saves] == [[[3]]]
    for b, v in ((3, 1.0), (4, 2.0), (5, 3.0), (6, 4.0)):
        _fill(pages, b, v)
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
    worker.wait_for_layer_load("layer.0")
    assert worker.get_block_ids_with_load_errors() == set()
    for layer in range(pages.num_layers):
        assert (pages.key(layer)[10].astype(float) == 1.0).all() and (pages.value(layer)[11].astype(float) == -2.0).all()


def test_a_block_that_fails_to_load_is_reported_with_everything_after_it(env) -> None:
    sched, worker, pages = env.sched, env.worker, env.pages
    prompt = list(range(7, 7 + 64))
    keys = prefix_chunk_keys(prompt, BS, salt=b"org/m@")
    for b in range(4):
        _fill(pages, b, float(b + 1))
    assert env.client.save(env.info.engine_id, [__import__("orbitkv_fs.manager", fromlist=["x"]).ChunkBlocks(k, [b])
                                                for b, k in enumerate(keys)]).chunks_saved == 4
    r = Req("r", prompt + [1])
    assert sched.get_num_new_matched_tokens(r, 0) == (64, False)
    sched.update_state_after_alloc(r, Blocks([20, 21, 22, 23, 24]), 64)
    meta = sched.build_connector_meta(_output(new=[_new(r, [20, 21, 22, 23, 24], 64)], scheduled={"r": 1}))
    # Between lookup and load the third block disappears (evicted, or a corrupt record).
    env.client.invalidate(chunks=[keys[2]], engine_id=env.info.engine_id)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    assert worker.get_block_ids_with_load_errors() == {22, 23}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once


def test_an_unreachable_manager_means_no_hits_and_no_errors(env) -> None:
    sched = OrbitKVConnector(_config(manager="tcp://127.0.0.1:9", cooldown_s=60, timeout_s=0.3), "scheduler", None)
    r = Req("r", list(range(64)))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched._guard.stats.failures == 1 and sched._guard.stats.skipped >= 1
    worker = OrbitKVConnector(_config(manager="tcp://127.0.0.1:9", timeout_s=0.3), "worker", None)
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


def test_worker_shutdown_unregisters_its_engine(env) -> None:
    assert [e.engine_id for e in env.manager.list_engines()] == [env.info.engine_id]
    env.sched.shutdown()  # the scheduler owns no registration
    assert len(env.manager.list_engines()) == 1
    env.worker.shutdown()
    assert env.manager.list_engines() == []
