"""Chunk keys carry everything that changes KV besides the tokens (issue 22, item 3): the LoRA adapter, the
request's ``cache_salt`` and multimodal inputs, as vLLM's own block hashes mix them in. Two values over the
same tokens never share a key, in the key derivation and through each adapter (vLLM, transformers,
SGLang): what one stored is a miss for the other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orbitkv_fs.connectors.common import KVInputs, MMInput, prefix_chunk_keys

TOKENS = list(range(1000, 1064))  # 4 blocks of 16
BS = 16

VARIANTS = {
    "lora": (KVInputs(lora="sql-adapter\0/loras/sql"), KVInputs(lora="chat-adapter\0/loras/chat")),
    "salt": (KVInputs(cache_salt="tenant-a"), KVInputs(cache_salt="tenant-b")),
    # The same placeholder tokens [20, 40) stand for two different images.
    "image": (KVInputs(mm=(MMInput("img-hash-cat", 20, 20),)), KVInputs(mm=(MMInput("img-hash-dog", 20, 20),))),
}


@pytest.mark.parametrize("what", list(VARIANTS))
def test_two_values_over_the_same_tokens_share_no_key(what: str) -> None:
    a, b = VARIANTS[what]
    ka, kb = prefix_chunk_keys(TOKENS, BS, inputs=a), prefix_chunk_keys(TOKENS, BS, inputs=b)
    plain = prefix_chunk_keys(TOKENS, BS)
    if what == "image":  # blocks before the image are the plain prompt's (vLLM's hashes likewise)
        assert ka[0] == kb[0] == plain[0]
        assert not set(ka[1:]) & set(kb[1:]) and not set(ka[1:]) & set(plain)
    else:
        assert not set(ka) & set(kb) and not set(ka) & set(plain)
    assert ka == prefix_chunk_keys(TOKENS, BS, inputs=a), "keys are a function of their inputs"


def test_no_inputs_keeps_the_token_keys_and_the_image_position_counts() -> None:
    assert prefix_chunk_keys(TOKENS, BS, inputs=KVInputs()) == prefix_chunk_keys(TOKENS, BS)
    img = MMInput("img", 20, 20)
    moved = MMInput("img", 24, 16)  # same picture, other placeholder position
    assert prefix_chunk_keys(TOKENS, BS, inputs=KVInputs(mm=(img,)))[1] != \
        prefix_chunk_keys(TOKENS, BS, inputs=KVInputs(mm=(moved,)))[1]
    # A salt spelled into the LoRA name cannot collide with the salt itself (length-prefixed fields).
    assert prefix_chunk_keys(TOKENS, BS, inputs=KVInputs(lora="x", cache_salt="y")) != \
        prefix_chunk_keys(TOKENS, BS, inputs=KVInputs(lora="x\0cache_salt\1\0\0\0\0\0\0\0y"))


# ------------------------------------------------------------------------------------------------- vLLM


def _vllm_request(rid: str, what: str, which: int) -> SimpleNamespace:
    """The fields of vllm.v1.request.Request the connector reads (their names are checked against the
    vLLM wheel by test_connectors_upstream.py)."""
    inputs = VARIANTS[what][which]
    lora = None
    if inputs.lora:
        name, path = inputs.lora.split("\0")
        lora = SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=which + 1)
    mm = [SimpleNamespace(identifier=m.identifier, mm_position=SimpleNamespace(offset=m.offset, length=m.length))
          for m in inputs.mm]
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS + [5], block_hashes=[], lora_request=lora,
                           cache_salt=inputs.cache_salt, mm_features=mm, prompt_embeds=None)


@pytest.mark.parametrize("what", list(VARIANTS))
def test_vllm_requests_differing_only_in_lora_salt_or_image_miss_each_other(what: str, tmp_path) -> None:
    pytest.importorskip("torch")
    from test_connectors_vllm import Blocks, VllmPages, _config, _new, _output  # noqa: PLC0415

    from orbitkv_fs.client import connect
    from orbitkv_fs.connectors.vllm import OrbitKVConnector
    from orbitkv_fs.manager import Manager, ManagerConfig

    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    kv = VllmPages(range(2), str(tmp_path))
    sched, worker = (OrbitKVConnector(_config(), role, None) for role in ("scheduler", "worker"))
    try:
        sched._client = worker._client = connect(m)
        worker.register_kv_caches(kv.kv)
        a = _vllm_request("a", what, 0)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        meta = sched.build_connector_meta(_output(new=[_new(a, [1, 2, 3, 4, 5], 0)], scheduled={"a": 65}))
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        sched.request_finished(a, [])
        # The same tokens with the other adapter / salt / image: nothing of a's is served.
        expect_other = 16 if what == "image" else 0  # the block before the image is the same KV
        assert sched.get_num_new_matched_tokens(_vllm_request("b", what, 1), 0) == (expect_other, False)
        assert sched.get_num_new_matched_tokens(_vllm_request("a2", what, 0), 0) == (64, False)
        # A request with prompt embeddings is never looked up.
        embeds = SimpleNamespace(**{**vars(_vllm_request("e", what, 0)), "prompt_embeds": object()})
        assert sched.get_num_new_matched_tokens(embeds, 0) == (0, False)
        assert Blocks  # the module's stand-ins, imported together
    finally:
        worker.shutdown()
        kv.close()
        m.close()


# --------------------------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("what", list(VARIANTS))
def test_transformers_store_keeps_two_adapters_salts_or_images_apart(what: str, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from orbitkv_fs.client import connect
    from orbitkv_fs.connectors.hf import HFPrefixStore
    from orbitkv_fs.manager import Manager, ManagerConfig

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    lm = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    store = HFPrefixStore.for_model(connect(m), lm, block_size=BS, slots=4, model="tiny")
    try:
        ids = torch.tensor([TOKENS + [5]])
        cache = transformers.DynamicCache(config=lm.config)
        with torch.inference_mode():
            lm(input_ids=ids[:, :64], past_key_values=cache, use_cache=True)
        a, b = VARIANTS[what]
        assert store.save(ids[:, :64], cache, a) == 64
        assert store.cached_tokens(ids, a) == 64
        assert store.cached_tokens(ids, b) == (16 if what == "image" else 0)
        assert store.restore(ids, b)[1] == (16 if what == "image" else 0)
        assert store.cached_tokens(ids) == (16 if what == "image" else 0)
    finally:
        store.close()
        m.close()


# ---------------------------------------------------------------------------------------------------- SGLang


def test_sglang_page_hashes_of_two_namespaces_miss_each_other(tmp_path) -> None:
    """SGLang seeds its storage hash chains with ``storage_namespace_seed(extra_key, cache_salt)`` (the LoRA
    id is part of ``extra_key``; images enter the token ids as pad values): the backend keys those hashes,
    so pages stored under one namespace are a miss under another (the seeding itself is checked against the
    SGLang wheel in test_connectors_upstream.py)."""
    pytest.importorskip("torch")
    from test_connectors_sglang import _backend, _indices, _pool  # noqa: PLC0415

    from orbitkv_fs.manager import Manager, ManagerConfig

    m = Manager(ManagerConfig(pool_size=64 << 20, device="cpu", shm_dir=str(tmp_path)))
    pool = _pool("layer_first")
    backend = _backend(m, pool)
    try:
        lora_a = ["a1" * 32, "a2" * 32]  # page hashes of one prompt under LoRA a
        lora_b = ["b1" * 32, "b2" * 32]  # the same prompt under LoRA b
        assert backend.batch_set_v1(lora_a, _indices([0, 1])) == [True, True]
        assert backend.batch_exists(lora_b) == 0 and backend.batch_exists(lora_a) == 2
    finally:
        backend.close()
        m.close()
