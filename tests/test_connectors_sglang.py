"""The SGLang HiCache backend driven the way SGLang's cache controller drives it, without SGLang.

SGLang's host pool is stood in by a record with the attributes and the ``kv_buffer`` shapes of its
``MHATokenToKVPoolHost`` for each layout (``test_connectors_upstream.py`` checks those shapes in the
SGLang wheel); the Manager is real (embedded).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from orbitkv_fs.connectors.sglang import OrbitKVHiCacheStorage  # noqa: E402
from orbitkv_fs.manager import Manager, ManagerConfig  # noqa: E402

T, L, H, D = 8, 3, 2, 32
PAGES = 12


def _pool(layout: str) -> SimpleNamespace:
    size = PAGES * T
    dims = {"layer_first": (2, L, size, H, D), "page_first": (2, size, L, H, D),
            "page_first_direct": (2, PAGES, L, T, H, D), "page_head": (2, PAGES, H, T, L, D)}[layout]
    g = torch.Generator().manual_seed(hash(layout) % 1000)
    buf = torch.randn(dims, generator=g).to(torch.bfloat16)
    return SimpleNamespace(layout=layout, page_size=T, layer_num=L, head_num=H, head_dim=D, dtype=torch.bfloat16,
                           kv_buffer=buf, size=size, page_num=PAGES)


def _flat_page(pool, index: int) -> torch.Tensor:  # MHATokenToKVPoolHost.get_data_page(index, flat=True)
    if pool.layout == "layer_first":
        return pool.kv_buffer[:, :, index: index + T].flatten()
    if pool.layout == "page_first":
        return pool.kv_buffer[:, index: index + T].flatten()
    return pool.kv_buffer[:, index // T: index // T + 1].flatten()


def _config(manager, **extra) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name="org/m",
                           extra_config={"backend_name": "orbitkv", "orbitkv.manager": manager,
                                         **{f"orbitkv.{k}": v for k, v in extra.items()}})


@pytest.fixture
def manager(tmp_path):
    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    yield m
    m.close()


def _backend(manager, pool, **extra) -> OrbitKVHiCacheStorage:
    b = OrbitKVHiCacheStorage(_config(manager, **extra), {})
    b.register_mem_pool_host(pool)
    return b


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * T, (p + 1) * T) for p in pages])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_v1_pages_round_trip_in_every_layout(manager, layout: str) -> None:
    pool = _pool(layout)
    backend = _backend(manager, pool, staging_pages=2)  # 5 pages > 2 staging slots: several rounds
    assert backend._slots == 2
    keys = [f"hash{i}" for i in range(5)]
    src = [0, 1, 2, 3, 4]
    before = [_flat_page(pool, p * T).clone() for p in src]
    assert backend.batch_set_v1(keys, _indices(src)) == [True] * 5
    assert backend.batch_exists(keys) == 5 and backend.exists("hash3") and not backend.exists("nope")
    dst = [7, 11, 5, 8, 10]
    assert backend.batch_get_v1(keys, _indices(dst)) == [True] * 5
    for b, p in zip(before, dst):
        assert torch.equal(_flat_page(pool, p * T), b)
    backend.close()


def test_a_missing_page_ends_the_hit(manager) -> None:
    pool = _pool("layer_first")
    backend = _backend(manager, pool)
    assert all(backend.batch_set_v1(["a", "b", "d"], _indices([0, 1, 2])))
    assert backend.batch_exists(["a", "b", "c", "d"]) == 2
    untouched = _flat_page(pool, 9 * T).clone()
    assert backend.batch_get_v1(["a", "c", "d"], _indices([8, 9, 10])) == [True, False, False]
    assert torch.equal(_flat_page(pool, 9 * T), untouched)  # nothing written for the miss
    backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_generic_flat_page_interface(manager, layout: str) -> None:
    pool = _pool(layout)
    backend = _backend(manager, pool)
    pages = [_flat_page(pool, p * T).clone() for p in (0, 1)]
    assert backend.batch_set(["x", "y"], pages) and backend.set("z", _flat_page(pool, 2 * T).clone())
    dummies = [torch.zeros(2 * L * T * H * D, dtype=torch.bfloat16) for _ in range(3)]
    got = backend.batch_get(["x", "y", "missing"], dummies)
    assert torch.equal(got[0], pages[0]) and torch.equal(got[1], pages[1]) and got[2] is None
    assert torch.equal(backend.get("z", torch.zeros_like(dummies[0])), _flat_page(pool, 2 * T))
    backend.close()


def test_pages_of_another_model_or_rank_are_not_served(manager) -> None:
    pool = _pool("layer_first")
    a = _backend(manager, pool)
    assert all(a.batch_set_v1(["k"], _indices([0])))
    other = OrbitKVHiCacheStorage(SimpleNamespace(**{**vars(_config(manager)), "tp_rank": 1, "tp_size": 2}), {})
    other.register_mem_pool_host(pool)
    assert other.batch_exists(["k"]) == 0
    a.close()
    other.close()


def test_unsupported_pools_disable_the_backend_without_errors(manager) -> None:
    backend = OrbitKVHiCacheStorage(SimpleNamespace(**{**vars(_config(manager)), "is_mla_model": True}), {})
    backend.register_mem_pool_host(_pool("layer_first"))
    assert backend.batch_set_v1(["a"], _indices([0])) == [False]
    assert backend.batch_get_v1(["a"], _indices([1])) == [False]
    assert backend.batch_exists(["a"]) == 0 and backend.get("a", torch.zeros(4)) is None
    backend.close()


def test_an_unreachable_manager_is_a_miss(manager) -> None:
    backend = _backend("tcp://127.0.0.1:9", _pool("layer_first"), timeout_s=0.3)
    assert backend.batch_set_v1(["a"], _indices([0])) == [False]
    assert backend.batch_exists(["a"]) == 0
    assert backend.get_stats()["failures"] == 1
    backend.close()


def test_a_restarted_manager_gets_the_staging_file_registered_again(tmp_path) -> None:
    """The Manager process restarts under a running SGLang server: its engines are gone. The backend
    registers its staging file again on the next call instead of missing until SGLang restarts."""
    import time

    from orbitkv_fs.dataplane import DataPlaneServer

    endpoint = f"ipc://{tmp_path}/dp.sock"
    m1 = Manager(ManagerConfig(pool_size=16 << 20, device="cpu"))
    srv1 = DataPlaneServer(m1, endpoint, workers=2)
    pool = _pool("page_first")
    backend = _backend(endpoint, pool, cooldown_s=0.2, timeout_s=2)
    m2 = srv2 = None
    try:
        first = backend._session.engine_id
        assert backend.batch_set_v1(["a"], _indices([0])) == [True]
        srv1.close()
        m1.close()
        m2 = Manager(ManagerConfig(pool_size=16 << 20, device="cpu"))
        srv2 = DataPlaneServer(m2, endpoint, workers=2)
        keys = ["b", "c"]
        ok = backend.batch_set_v1(keys, _indices([1, 2]))
        if ok != [True, True]:  # the old connection broke with the old process: a miss, then the cool-down
            assert backend._guard.stats.failures == 1
            time.sleep(0.3)
            ok = backend.batch_set_v1(keys, _indices([1, 2]))
        assert ok == [True, True] and backend._session.reregistrations == 1
        assert [e.engine_id for e in m2.list_engines()] == [backend._session.engine_id] != [first]
        assert backend.batch_exists(keys) == 2 and backend.batch_exists(["a"]) == 0  # "a" died with m1
        before = _flat_page(pool, 2 * T).clone()
        assert backend.batch_get_v1(["c"], _indices([9])) == [True]
        assert torch.equal(_flat_page(pool, 9 * T), before)
    finally:
        backend.close()
        if srv2 is not None:
            srv2.close()
        if m2 is not None:
            m2.close()


def test_a_backend_started_before_its_manager_registers_once_the_manager_is_up(tmp_path) -> None:
    import time

    from orbitkv_fs.dataplane import DataPlaneServer

    endpoint = f"ipc://{tmp_path}/dp.sock"
    pool = _pool("layer_first")
    backend = _backend(endpoint, pool, cooldown_s=0.2, timeout_s=2)
    m = srv = None
    try:
        assert backend._session is None and backend.batch_set_v1(["a"], _indices([0])) == [False]
        m = Manager(ManagerConfig(pool_size=16 << 20, device="cpu"))
        srv = DataPlaneServer(m, endpoint, workers=2)
        time.sleep(0.3)
        assert backend.batch_set_v1(["a"], _indices([0])) == [True]
        assert len(m.list_engines()) == 1 and backend.batch_exists(["a"]) == 1
    finally:
        backend.close()
        if srv is not None:
            srv.close()
        if m is not None:
            m.close()


def test_pages_the_manager_dropped_are_not_reported_stored() -> None:
    """A Manager with no room (here: a pool smaller than one segment, no SSD) drops the segments; SGLang
    must not be told those pages are in storage."""
    with Manager(ManagerConfig(pool_size=512, device="cpu")) as m:
        pool = _pool("layer_first")
        backend = _backend(m, pool)
        try:
            assert backend.batch_set_v1(["a", "b"], _indices([0, 1])) == [False, False]
            assert m.stats().dropped_segments > 0 and backend.batch_exists(["a", "b"]) == 0
        finally:
            backend.close()


@pytest.mark.parametrize("op", ["batch_set_v1", "batch_get_v1"])
def test_close_waits_for_a_transfer_in_flight(manager, op: str) -> None:
    # SGLang's backup and prefetch threads can be inside a transfer when the backend is closed: the transfer
    # finishes (or reports a miss), it never raises into SGLang's thread or touches closed staging pages.
    import threading

    pool = _pool("layer_first")
    backend = _backend(manager, pool, staging_pages=2)
    keys = [f"hash{i}" for i in range(5)]  # 3 rounds of 2 staging slots
    assert backend.batch_set_v1(keys, _indices([0, 1, 2, 3, 4])) == [True] * 5
    session = backend._session
    name = "save" if op == "batch_set_v1" else "restore"
    real = getattr(session, name)
    inside, go = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        inside.set()
        go.wait(10)
        return real(*args, **kwargs)

    setattr(session, name, held)
    result: list = []
    errors: list = []

    def transfer() -> None:
        try:
            result.append(getattr(backend, op)(keys, _indices([5, 6, 7, 8, 9])))
        except BaseException as e:  # noqa: BLE001 -- what would reach SGLang's thread
            errors.append(e)

    t = threading.Thread(target=transfer)
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # close waits for the transfer in flight
    go.set()
    t.join(10)
    closer.join(10)
    assert not errors, errors
    assert len(result[0]) == 5
    assert session.reregistrations == 0 and manager.stats().engines == 0  # not registered again after close
