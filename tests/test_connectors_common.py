"""Source-only tests of the engine-independent adapter logic (no engine, no torch, no GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orbitkv_fs.connectors.common import (
    BlockMath,
    KeyDerivationError,
    ManagerGuard,
    engine_hash_keys,
    leading_run,
    prefix_chunk_keys,
)
from orbitkv_fs.errors import OrbitKVError, PayloadChecksumMismatch

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@given(tokens, st.integers(1, 16))
def test_prefix_keys_cover_full_blocks_and_are_prefix_stable(ids: list[int], bs: int) -> None:
    keys = prefix_chunk_keys(ids, bs)
    assert len(keys) == len(ids) // bs
    assert all(len(k) == 16 for k in keys)
    # A longer prompt sharing the prefix shares the prefix's keys: that is what makes a hit.
    assert prefix_chunk_keys(ids + [7] * bs, bs)[: len(keys)] == keys
    # Chaining in pieces gives the same keys as hashing at once.
    if len(keys) >= 2:
        head = prefix_chunk_keys(ids[:bs], bs)
        tail = prefix_chunk_keys(ids[bs:], bs, parent=head[-1])
        assert head + tail == keys


def test_prefix_keys_depend_on_every_earlier_token_and_on_the_salt() -> None:
    a = prefix_chunk_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_chunk_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix: different key
    assert prefix_chunk_keys([1, 2, 3, 4], 4, salt=b"model-a") != prefix_chunk_keys([1, 2, 3, 4], 4, salt=b"model-b")
    # Fixed-width token packing: (1, 23) and (12, 3) never collide.
    assert prefix_chunk_keys([1, 23], 2) != prefix_chunk_keys([12, 3], 2)


def test_prefix_keys_are_the_same_in_another_process() -> None:
    """Keys must not depend on process state (Python's hash seed): a new engine finds old saves."""
    code = ("from orbitkv_fs.connectors.common import prefix_chunk_keys;"
            "print(prefix_chunk_keys(list(range(32)), 8, salt=b's')[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {prefix_chunk_keys(list(range(32)), 8, salt=b"s")[-1].hex()}


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_bad_token_ids_are_typed_errors(bad: list[int]) -> None:
    with pytest.raises(KeyDerivationError):
        prefix_chunk_keys(bad, 1)


@pytest.mark.parametrize("bs", [0, -4, 2.5])
def test_bad_block_size_is_a_typed_error(bs) -> None:
    with pytest.raises(KeyDerivationError):
        BlockMath(bs)
    with pytest.raises(KeyDerivationError):
        prefix_chunk_keys([1, 2], bs)


def test_engine_hash_keys() -> None:
    hashes = [b"\x01" * 32, b"\x02" * 32]
    keys = engine_hash_keys(hashes, salt=b"m")
    assert len(set(keys)) == 2 and all(len(k) == 16 for k in keys)
    assert engine_hash_keys(hashes, salt=b"other") != keys
    assert engine_hash_keys(["abc", 12345]) == engine_hash_keys([b"abc", 12345])


def test_block_math() -> None:
    bm = BlockMath(16)
    assert bm.full_blocks(0) == 0 and bm.full_blocks(15) == 0 and bm.full_blocks(33) == 2
    # 48-token prompt, all three blocks cached: the engine must still compute one token, so only two load.
    assert bm.loadable_blocks(48, 3) == 2
    assert bm.loadable_blocks(49, 3) == 3
    assert bm.loadable_blocks(1, 5) == 0
    assert bm.new_matched_tokens(49, 3, 0) == 48
    assert bm.new_matched_tokens(49, 3, 16) == 32  # the engine's own prefix cache already has block 0
    assert bm.new_matched_tokens(49, 1, 32) == 0  # never negative
    assert list(bm.slots(2)) == list(range(32, 48))


@given(st.integers(1, 64), st.integers(0, 500), st.integers(0, 40), st.integers(0, 500))
def test_new_matched_tokens_is_block_aligned_and_leaves_one_token(bs, n_prompt, hit, computed) -> None:
    bm = BlockMath(bs)
    computed = computed // bs * bs  # vLLM's local hits are block-aligned
    n = bm.new_matched_tokens(n_prompt, hit, computed)
    assert n >= 0
    if n:
        assert (computed + n) % bs == 0
        assert computed + n <= n_prompt - 1
        assert (computed + n) // bs <= hit


def test_leading_run() -> None:
    assert leading_run([]) == 0 and leading_run([True, True, False, True]) == 2


def test_a_load_job_fails_every_block_from_a_transfer_s_first_miss() -> None:
    """A prefix is usable only up to its first hole: the first missed chunk and all later ones of the same
    transfer are failed, whichever layer group missed them; other transfers are unaffected."""
    from orbitkv_fs.connectors.common import LayerLoadJob, Transfer

    keys = [bytes([i]) * 16 for i in range(4)]

    class Session:
        def __init__(self) -> None:
            self.asked: list[tuple[list[bytes], list[int]]] = []

        def restore(self, ks, blocks, *, layers):
            self.asked.append((list(ks), layers))
            return {0: [keys[3]], 1: [keys[1]]}[layers[0]]

    s = Session()
    job = LayerLoadJob(s, [Transfer("a", keys, [[10], [11], [12], [13]]), Transfer("b", keys[:1], [[20, 21]])],
                       [[0], [1]])
    job.run()
    assert job.wait() == {11, 12, 13}
    assert s.asked == [(keys, [0]), (keys[:1], [0]), (keys[:3], [1]), (keys[:1], [1])]
    unregistered = LayerLoadJob(None, [Transfer("a", keys[:2], [[1], [2]])], [[0]])
    unregistered.run()
    assert unregistered.wait() == {1, 2}  # no session: everything is a miss


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_manager_guard_turns_outages_into_misses_and_cools_down() -> None:
    clock = _Clock()
    g = ManagerGuard(cooldown_s=5.0, clock=clock)
    calls = []

    def lookup() -> int:
        calls.append(1)
        return 3

    def down() -> int:
        raise ConnectionRefusedError("manager down")

    assert g.call("lookup", lookup, 0) == 3
    assert g.call("lookup", down, 0) == 0
    assert g.stats.failures == 1 and "ConnectionRefusedError" in g.stats.last_error
    # While cooling down, the Manager is not called at all.
    assert g.call("lookup", lookup, 0) == 0 and len(calls) == 1 and g.stats.skipped == 1
    clock.t = 5.0
    assert g.call("lookup", lookup, 0) == 3 and len(calls) == 2
    # Typed errors from the Manager (a corrupt segment, ...) are misses too.
    def corrupt() -> int:
        raise PayloadChecksumMismatch("bad crc")
    assert g.call("restore", corrupt, -1) == -1 and isinstance(PayloadChecksumMismatch("x"), OrbitKVError)


def test_a_failure_after_a_successful_probe_starts_a_fresh_cooldown() -> None:
    """Only failed probes double the cool-down: a Manager that answers the probe but fails the call (e.g.
    it restarted and does not know the engine yet) is retried after the base cool-down again."""
    clock = _Clock()
    g = ManagerGuard(cooldown_s=5.0, max_cooldown_s=60.0, probe=lambda: None, clock=clock)

    def down() -> int:
        raise ConnectionResetError("restarting")

    for t in (0.0, 5.0, 10.0, 15.0):  # each round: the probe succeeds, the call fails
        clock.t = t
        assert g.call("lookup", down, 0) == 0
        assert not g.healthy and g._open_until == t + 5.0, (t, g._open_until)
    assert g.stats.failures == 4 and g.stats.probes_failed == 0


def test_manager_guard_does_not_hide_bugs() -> None:
    g = ManagerGuard()
    with pytest.raises(TypeError):
        g.call("lookup", lambda: None + 1, 0)


def test_rest_registration_body_sends_object_names_and_base64_ipc_handles(tmp_path) -> None:
    import base64

    from orbitkv_fs.connectors.common import RestRegistrar, StagingPages
    from orbitkv_fs.geometry import CudaIpcHandle, TensorDesc

    pages = StagingPages(num_layers=1, slots=2, block_size=4, num_heads=1, head_dim=8, dtype="bfloat16",
                         directory=str(tmp_path))
    try:
        reg = pages.registration(model="m", engine_kind="test")
        body = RestRegistrar.body(reg)
        assert body["tensors"][0]["handle"] == {"type": "host", "name": Path(pages.pages.path).name,
                                                "offset": reg.tensors[0].handle.offset}
        assert "/" not in body["tensors"][0]["handle"]["name"]  # names, never paths
        ipc = TensorDesc(layer=0, role="kv", layout="vllm_packed", shape=[2, 1, 4, 16], strides=[64, 64, 16, 1],
                         dtype="bfloat16", handle=CudaIpcHandle(bytes(range(64)), 4096, 1, 1 << 20))
        body = RestRegistrar.body(msgspec.structs.replace(reg, tensors=[ipc]))
        h = body["tensors"][0]["handle"]
        assert h["type"] == "cuda_ipc" and base64.b64decode(h["handle"]) == bytes(range(64))
        assert (h["offset"], h["device"], h["size"]) == (4096, 1, 1 << 20)
        assert body["model"] == "m" and body["block_size"] == 4
    finally:
        pages.close()


def test_cuda_ipc_mem_handle_from_torch_handles():
    from orbitkv_fs.connectors.common import cuda_ipc_mem_handle

    raw = bytes(range(64))
    assert cuda_ipc_mem_handle(raw) == raw  # torch before versioned handles
    for version in (2, 3):  # torch <= 2.12, torch >= 2.13: same 'c' payload
        assert cuda_ipc_mem_handle(bytes([version]) + b"c" + raw) == raw
    assert cuda_ipc_mem_handle(bytes([3]) + b"e" + raw) is None  # expandable segment: not cudaIpc-openable
    assert cuda_ipc_mem_handle(raw[:40]) is None


def test_a_dead_manager_costs_one_short_probe_per_growing_cooldown(tmp_path) -> None:
    """The first failure costs one call timeout; after that each cool-down ends with a short ping, and
    while the Manager stays down the cool-down doubles. A Manager that comes back is used again at once."""
    import time

    from orbitkv_fs.connectors.common import connect_client, ping_probe
    from orbitkv_fs.dataplane import DataPlaneServer, RemoteClient
    from orbitkv_fs.manager import Manager, ManagerConfig

    endpoint = f"ipc://{tmp_path}/dp.sock"
    clock = _Clock()
    g = ManagerGuard(cooldown_s=5.0, max_cooldown_s=15.0, clock=clock, probe=ping_probe(endpoint, timeout_s=0.2))
    client = RemoteClient(endpoint, timeout=1.0)
    calls = []

    def stats() -> object:
        calls.append(1)
        return client.stats()

    try:
        assert g.call("stats", stats, None) is None and len(calls) == 1
        for n, (t, cooldown) in enumerate(((5.0, 10.0), (15.0, 15.0), (30.0, 15.0))):
            clock.t = t - 0.1
            skipped = g.stats.skipped
            assert g.call("stats", stats, None) is None  # still cooling down: no probe, no call
            assert g.stats.skipped == skipped + 1 and g.stats.probes_failed == n
            clock.t = t
            t0 = time.monotonic()
            assert g.call("stats", stats, None) is None
            assert time.monotonic() - t0 < 0.9  # the probe's timeout, not the call's
            assert len(calls) == 1  # the real call was never made
            assert g._open_until == pytest.approx(t + cooldown)
        assert g.stats.probes_failed == 3
        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
            srv = DataPlaneServer(m, endpoint, workers=1)
            try:
                clock.t = 45.0
                assert g.call("stats", stats, None) is not None and len(calls) == 2
                assert g.healthy and g.stats.failures == 4
                # Recovered: the next outage starts again at the base cool-down.
                assert g.call("stats", lambda: connect_client(f"ipc://{tmp_path}/other.sock", timeout_s=0.2), None) is None
                assert g._open_until == pytest.approx(45.0 + 5.0)
            finally:
                srv.close()
    finally:
        client.close()


def test_a_load_job_that_hits_a_bug_wakes_its_waiters_and_reraises() -> None:
    import threading

    from orbitkv_fs.connectors.common import LayerLoadJob, Transfer

    class Broken:
        def restore(self, keys, blocks, *, layers=None):
            if layers == [1]:
                raise TypeError("bug")
            return []

    job = LayerLoadJob(Broken(), [Transfer("r", [b"k" * 16], [[3]])], [[0], [1], [2]])
    t = threading.Thread(target=job.run)
    t.start()
    job.wait_layer(0)
    job.wait_layer(2)  # returns: the job ended, it does not hang
    t.join()
    with pytest.raises(TypeError, match="bug"):
        job.wait()


def test_a_gpu_tensor_whose_memory_has_no_ipc_handle_is_not_shared_and_does_not_fail(caplog) -> None:
    """vLLM's sleep mode allocates the KV cache through a pluggable (cuMem) allocator, and torch's
    ``cudaMallocAsync`` backend serves any tensor: their storages refuse ``_share_cuda_`` (torch's own
    messages below). The tensor has no handle (the adapter stages its KV or stays off), the worker goes on."""
    from types import SimpleNamespace

    from orbitkv_fs.connectors.common import tensor_handle

    for who in ("CUDAPluggableAllocator does not yet support shareIPcHandle",
                "cudaMallocAsync does not yet support shareIpcHandle"):

        def refuse(who=who):
            raise RuntimeError(who + ". If you need it, please file an issue describing your use case.")

        t = SimpleNamespace(is_cuda=True, untyped_storage=lambda: SimpleNamespace(_share_cuda_=refuse))
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert tensor_handle(t) is None
        assert "cannot be shared through CUDA IPC" in caplog.text and who in caplog.text


def test_tensor_handle_finds_shared_pages_and_refuses_private_memory(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import numpy as np

    from orbitkv_fs.connectors.common import tensor_handle
    from orbitkv_fs.geometry import HostPagesHandle
    from orbitkv_fs.pages import HostPages

    pages = HostPages.create([("a", (8, 64), "float32", "opaque"), ("b", (8, 64), "float32", "opaque")],
                             directory=str(tmp_path))
    try:
        b = torch.from_numpy(pages.array("b"))
        assert tensor_handle(b) == HostPagesHandle(pages.path, pages.tensors["b"].offset)
        assert tensor_handle(torch.zeros(8, 64)) is None
        assert tensor_handle(torch.from_numpy(np.zeros((8, 64), np.float32))) is None
    finally:
        del b
        pages.close()
