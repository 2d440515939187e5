"""The vLLM connector on GPU pages (device machine): vLLM-named torch CUDA tensors in vLLM's packed layout
(``[blocks, kv_heads, block_size, 2 * head_dim]``, BF16), registered through CUDA IPC with a separate
``orbitkv-cache-manager`` process, as a vLLM worker does; vLLM's scheduler calls stood in as in
``test_connectors_vllm.py``.

Chunks of four blocks: a prompt's full chunks are saved; a later request whose own prefix cache holds the
first five blocks loads blocks 5-11 (SKIP_BLOCK at the shared block of chunk 1), which must equal what was
saved, while the shared block and every other block keep what they held.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_connectors_vllm as v  # noqa: E402  (vLLM's request, block and scheduler-output stand-ins)
from test_e2e_smollm2 import ManagerProcess  # noqa: E402

from orbitkv_fs.connectors.vllm import OrbitKVConnector  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, HEADS, HD = 4, 64, 8, 128


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_vllm_connector_on_cuda_pages_loads_around_its_own_blocks(codec: str, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    manager = ManagerProcess(tmp_path, device="auto", pool_size="256mib", ssd_capacity="256mib")
    sched = worker = None
    try:
        torch.manual_seed(0)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kv = {n: torch.randn(BLOCKS, HEADS, v.BS, 2 * HD, device="cuda").to(torch.bfloat16) for n in names}
        cfg = v._config(layers=LAYERS, manager=manager.data_plane, chunk_tokens=4 * v.BS, codec=codec)
        sched, worker = OrbitKVConnector(cfg, "scheduler", None), OrbitKVConnector(cfg, "worker", None)
        worker.register_kv_caches(kv)
        assert worker._session is not None

        prompt = list(range(1000, 1200))  # 200 tokens: 12 full blocks, 3 full chunks
        own = list(range(12))
        r1 = v.Req("r1", prompt)
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
        sched.update_state_after_alloc(r1, v.Blocks([]), 0)
        meta = sched.build_connector_meta(v._output(new=[v._new(r1, own + [12], 0)], scheduled={"r1": 200}))
        assert [t.blocks for t in meta.saves] == [[own[0:4], own[4:8], own[8:12]]]
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        sched.request_finished(r1, own + [12])

        new = list(range(30, 40))
        for t in kv.values():
            t[4] = 7.0  # the block vLLM shares with r2: a write into it would show
            t[new] = 0.0
        before = {n: t.clone() for n, t in kv.items()}
        r2 = v.Req("r2", prompt + [5] * 40)
        assert sched.get_num_new_matched_tokens(r2, 80) == (112, False)
        sched.update_state_after_alloc(r2, v.Blocks(own[:5] + new), 112)
        meta = sched.build_connector_meta(v._output(new=[v._new(r2, own[:5] + new, 192)], scheduled={"r2": 48}))
        assert [t.blocks for t in meta.loads] == [[[v.SKIP_BLOCK] + new[0:3], new[3:7]]]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(SimpleNamespace())
        for n in names:
            worker.wait_for_layer_load(n)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == set()
        torch.cuda.synchronize()

        loaded, sources = new[:7], own[5:12]  # position p of r2 holds what r1's block at position p held
        for n, t in kv.items():
            got, want = t[loaded].float(), before[n][sources].float()
            if codec == "none":
                assert torch.equal(t[loaded], before[n][sources]), n
            else:  # E4M3: 3 mantissa bits
                assert bool(((got - want).abs() <= want.abs() / 16 + 2.0 ** -9).all()), n
            rest = [b for b in range(BLOCKS) if b not in loaded]
            assert torch.equal(t[rest], before[n][rest]), n  # the shared block 4 included
        st = manager.stats()
        assert st["reserved_bytes"] == 0 and st["leases_active"] == 0
    finally:
        for c in (worker, sched):
            if c is not None:
                c.shutdown()
        manager.close()
