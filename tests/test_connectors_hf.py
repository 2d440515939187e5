"""The transformers adapter against the real (embedded) Manager and a real transformers model.

The model is a small randomly initialised Llama (real transformers code, seconds to build) so that these
tests stay fast; the real SmolLM2 runs in ``test_e2e_smollm2.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from orbitkv_fs.client import connect  # noqa: E402
from orbitkv_fs.connectors.common import prefix_chunk_keys  # noqa: E402
from orbitkv_fs.connectors.hf import HFPrefixStore  # noqa: E402
from orbitkv_fs.manager import Manager, ManagerConfig  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


@pytest.fixture
def manager(tmp_path):
    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    yield m
    m.close()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (1, n), generator=g)


def _prefill(lm, ids: torch.Tensor, n: int):
    cache = transformers.DynamicCache(config=lm.config)
    with torch.inference_mode():
        lm(input_ids=ids[:, :n], past_key_values=cache, use_cache=True)
    return cache


def _generate(lm, ids: torch.Tensor, cache) -> list[int]:
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                          min_new_tokens=8, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _same_kv(a, b, n: int) -> bool:
    return all(torch.equal(x.keys, y.keys[:, :, :n]) and torch.equal(x.values, y.values[:, :, :n])
               for x, y in zip(a.layers, b.layers))


def test_save_restore_is_bit_exact_and_generation_identical(lm, manager) -> None:
    store = HFPrefixStore.for_model(connect(manager), lm, block_size=BS, slots=2, model="tiny-llama")
    ids = _ids(41)
    cache = _prefill(lm, ids, 40)
    assert store.save(ids[:, :40], cache) == 32  # only full blocks
    assert store.cached_tokens(ids) == 32
    restored, n = store.restore(ids)  # two staging rounds: slots=2 < ... (2 blocks, exactly one round)
    assert n == 32 and _same_kv(restored, cache, 32)
    control = _generate(lm, ids, _prefill(lm, ids, 32))
    assert _generate(lm, ids, restored) == control
    # The keys are the documented chained prefix keys, salted with the model identity.
    assert store.keys(ids) == prefix_chunk_keys(ids[0].tolist(), BS, salt=b"tiny-llama@")
    store.close()


def test_more_blocks_than_staging_slots(lm, manager) -> None:
    store = HFPrefixStore.for_model(connect(manager), lm, block_size=BS, slots=2, model="tiny-llama")
    ids = _ids(90, seed=2)
    cache = _prefill(lm, ids, 90)
    assert store.save(ids, cache) == 80
    restored, n = store.restore(ids)
    assert n == 80 and _same_kv(restored, cache, 80)
    store.close()


def test_restore_leaves_the_last_prompt_token_and_shares_prefixes(lm, manager) -> None:
    store = HFPrefixStore.for_model(connect(manager), lm, block_size=BS, model="tiny-llama")
    ids = _ids(48, seed=3)
    store.save(ids, _prefill(lm, ids, 48))
    # A 48-token prompt: all three blocks stored, but the model must compute the last token itself.
    assert store.restore(ids)[1] == 32
    assert store.restore(ids[:, :49])[1] == 32
    # A prompt sharing only the first block.
    other = torch.cat([ids[:, :16], _ids(30, seed=4)], dim=1)
    cache, n = store.restore(other)
    assert n == 16 and _same_kv(cache, _prefill(lm, other, 16), 16)
    # Nothing stored for an unrelated prompt.
    assert store.restore(_ids(40, seed=5)) == (None, 0)
    store.close()


def test_a_missing_block_cuts_the_prefix(lm, manager) -> None:
    client = connect(manager)
    store = HFPrefixStore.for_model(client, lm, block_size=BS, model="tiny-llama")
    ids = _ids(70, seed=6)
    store.save(ids, _prefill(lm, ids, 70))
    keys = store.keys(ids)
    client.invalidate(chunks=[keys[2]], engine_id=store.engine_id)
    cache, n = store.restore(ids)
    assert n == 32
    assert _generate(lm, ids, cache) == _generate(lm, ids, _prefill(lm, ids, 32))
    store.close()


class _DownClient:
    """Fault injection: a client whose Manager is unreachable after registration."""

    def __init__(self, real) -> None:
        self.real = real

    def register(self, reg):
        return self.real.register(reg)

    def unregister(self, engine_id):
        return self.real.unregister(engine_id)

    def _down(self, *a, **k):
        raise ConnectionRefusedError("manager went away")

    lookup = save = restore = _down


def test_an_unreachable_manager_is_a_miss_not_an_error(lm, manager) -> None:
    store = HFPrefixStore.for_model(_DownClient(connect(manager)), lm, block_size=BS, model="tiny-llama")
    ids = _ids(40, seed=7)
    assert store.save(ids, _prefill(lm, ids, 40)) == 0
    assert store.restore(ids) == (None, 0)
    assert store.guard.stats.failures == 1 and store.guard.stats.skipped >= 1
    assert len(_generate(lm, ids, None)) == 8  # the engine carries on without the cache
    store.close()


def test_fp32_model_with_a_bf16_kv_cache(lm, manager) -> None:
    lm32 = lm.to(torch.float32)
    try:
        store = HFPrefixStore.for_model(connect(manager), lm32, block_size=BS, model="tiny-llama-32", dtype="bfloat16")
        ids = _ids(40, seed=9)
        cache = store.new_cache()
        with torch.inference_mode():
            lm32(input_ids=ids[:, :32], past_key_values=cache, use_cache=True)
        assert cache.layers[0].keys.dtype == torch.float32
        assert torch.equal(cache.layers[0].keys, cache.layers[0].keys.to(torch.bfloat16).float())
        store.save(ids[:, :32], cache)
        restored, n = store.restore(ids)
        assert n == 32 and restored.layers[0].keys.dtype == torch.float32 and _same_kv(restored, cache, 32)
        assert _generate(lm32, ids, restored) == _generate(lm32, ids, cache)
        store.close()
    finally:
        lm.to(torch.bfloat16)


def test_lossy_codec_restores_close_values(lm, manager) -> None:
    store = HFPrefixStore.for_model(connect(manager), lm, block_size=BS, model="tiny-llama", codec="fp8")
    assert store.engine_info.codec == "fp8"
    ids = _ids(40, seed=8)
    cache = _prefill(lm, ids, 40)
    store.save(ids, cache)
    restored, n = store.restore(ids)
    assert n == 32
    worst = max(float((a.keys.float() - b.keys[:, :, :32].float()).abs().max()) for a, b in
                zip(restored.layers, cache.layers))
    scale = max(float(b.keys.float().abs().max()) for b in cache.layers)
    assert 0 < worst <= scale / 8  # E4M3 has a 3-bit mantissa: relative error <= 2**-4, plus subnormals
    store.close()


def test_blocks_the_manager_had_no_room_for_are_not_counted_stored(lm) -> None:
    with Manager(ManagerConfig(pool_size=512, device="cpu")) as m:  # smaller than one segment, no SSD
        store = HFPrefixStore.for_model(connect(m), lm, block_size=BS, model="tiny-llama")
        ids = _ids(40, seed=3)
        assert store.save(ids, _prefill(lm, ids, 40)) == 0
        assert m.stats().dropped_segments > 0 and store.restore(ids) == (None, 0)
        store.close()
