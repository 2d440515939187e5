"""Adapters registering over the HTTP control plane of a real ``orbitkv-cache-manager`` process and moving
KV over its data plane (the transformers store, with a small real transformers model)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_e2e_smollm2 import ManagerProcess  # noqa: E402

from orbitkv_fs.connectors.common import RestRegistrar, connect_client  # noqa: E402
from orbitkv_fs.connectors.hf import HFPrefixStore  # noqa: E402
from orbitkv_fs.errors import OrbitKVError  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    m = ManagerProcess(tmp_path_factory.mktemp("mgr"))
    yield m
    m.close()


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _engines(manager) -> list[dict]:
    with urllib.request.urlopen(f"http://{manager.http}/v1/engines", timeout=10) as r:
        return json.loads(r.read())["engines"]


def test_register_over_rest_then_save_and_restore_over_the_data_plane(manager, lm) -> None:
    client = connect_client(manager.data_plane, timeout_s=30)
    store = HFPrefixStore.for_model(client, lm, block_size=BS, model="tiny-rest", http=manager.http)
    assert store.session is not None and store.engine_info is None
    listed = {e["engine_id"]: e for e in _engines(manager)}
    assert listed[store.engine_id]["engine_kind"] == "transformers" and listed[store.engine_id]["model"] == "tiny-rest"
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=lm.config)
    with torch.inference_mode():
        lm(input_ids=ids[:, :32], past_key_values=cache, use_cache=True)
    assert store.save(ids[:, :32], cache) == 32
    restored, n = store.restore(ids)
    assert n == 32
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(restored.layers, cache.layers))
    engine_id = store.engine_id
    store.close()
    assert engine_id is not None and store.engine_id is None
    assert engine_id not in {e["engine_id"] for e in _engines(manager)}  # DELETE /v1/engines/{id}
    client.close()


def test_rest_errors_are_typed_and_leave_the_adapter_off(manager, lm) -> None:
    reg_store = HFPrefixStore.for_model(connect_client(manager.data_plane), lm, block_size=BS, model="x",
                                        http="127.0.0.1:9")  # nothing listens there
    assert reg_store.session is None and reg_store.guard.stats.failures == 1
    reg_store.close()
    with pytest.raises(OrbitKVError, match="404"):
        RestRegistrar(manager.http).unregister("no-such-engine")
