"""The cuFile direct path end to end, on a GPU with kvikio: saves write complete state groups from the GPU
straight to the SSD, restores read SSD records into device memory and decode them there; corrupt records
are misses for their chunk only; direct records are ordinary records for io_uring and orbitkv-inspect.

GPU machines only (the engine process and helpers come from test_manager_gpu.py)."""

from __future__ import annotations


import numpy as np
import pytest

from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.segment import Role
from test_manager_gpu import B, L, NBYTES, _registration, assert_restored, engine_process
from test_ssd_common import direct_io_dir, flip

pytestmark = pytest.mark.gpu

NSEG = 2 * L  # segments per chunk
CHUNKS = B // 2  # two blocks per chunk


@pytest.fixture(scope="module")
def engine():
    """One engine process for the module (each test resets its KV to the original: ``_original_kv``)."""
    with engine_process() as e:
        yield e


@pytest.fixture(autouse=True)
def _original_kv(engine):
    """Every test starts from the engine's original KV: a lossy codec's restore leaves its rounding behind."""
    cmd, reply, _, _ = engine
    cmd.put("reset")
    reply.get(timeout=60)


def _tier(paths, *, backend: str = "cufile", recover: bool = False):
    pytest.importorskip("kvikio")
    from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

    return SsdTier(SsdConfig(paths=tuple(paths), capacity=64 << 20, backend=backend, recover=recover))


def _chunks(salt: str) -> list[ChunkBlocks]:
    return [ChunkBlocks(chunk_key(f"{salt}{i}"), [2 * i, 2 * i + 1]) for i in range(CHUNKS)]


def _blocks_of(kv: np.ndarray, chunk: int) -> np.ndarray:
    """Chunk ``chunk``'s blocks of every (layer, role) tensor of the engine's KV (uint16 words)."""
    per_block = NBYTES // 2 // B
    t = kv.reshape(2 * L, B, per_block)
    return t[:, 2 * chunk:2 * chunk + 2]


@pytest.mark.parametrize("codec", ["none", "ans", "fp8", "turboquant-4"])
def test_save_direct_evict_restore_from_device(codec, engine, tmp_path):
    cmd, reply, handle, original = engine
    d = direct_io_dir(tmp_path)
    tier = _tier([d / "a.okv", d / "b.okv"])
    # 18 segments per batch, 12 per chunk: a whole chunk and half the next, which is more than a quarter of a
    # batch, so split over two batches (batching.ALIGN_SHARE): every other chunk is a fragmented group.
    # No readahead: the lookup below would prefetch the next chunks into DRAM in the background, racing
    # the direct reads this test counts and holding arena reservations while it checks they are zero.
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, batch_segments=18, ssd_prefetch_chunks=0),
                 lower_tier=tier) as m:
        e = m.register_engine(_registration(handle))
        chunks = _chunks(f"d-{codec}-")
        assert m.save(e.engine_id, chunks).segments == CHUNKS * NSEG
        st = m.stats()
        assert 0 < st.ssd_direct_writes < CHUNKS * NSEG  # fragmented groups (and host fallbacks) wait
        assert st.lower["ssd_write_device_total"] == st.ssd_direct_writes
        tier.flush()
        f = m.flush_dram()  # evicts everything: direct records are not written a second time
        assert f.dropped.objects == 0
        assert tier.snapshot().write_already_stored_total == st.ssd_direct_writes
        assert tier.snapshot().objects == CHUNKS * NSEG
        cmd.put("zero")
        reply.get(timeout=60)
        # Two chunks go back to DRAM through a lookup (host path); the rest come straight from SSD to GPU.
        lk = m.lookup(e.engine_id, [c.key for c in chunks[:2]])
        assert lk.count == 2
        res = m.restore(e.engine_id, chunks, lease_id=lk.lease_id)
        assert all(res.restored), res.misses
        assert res.segments == CHUNKS * NSEG
        st = m.stats()
        assert st.ssd_direct_reads == (CHUNKS - 2) * NSEG
        assert st.lower["ssd_read_device_total"] == (CHUNKS - 2) * NSEG
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), dtype=np.uint16)
    assert_restored(got, np.frombuffer(original, dtype=np.uint16), codec)


def test_corrupt_record_is_a_miss_for_its_chunk_only(engine, tmp_path):
    cmd, reply, handle, original = engine
    d = direct_io_dir(tmp_path)
    path = str(d / "c.okv")
    tier = _tier([path])
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec="none", batch_segments=NSEG), lower_tier=tier) as m:
        e = m.register_engine(_registration(handle))
        chunks = _chunks("corrupt-")
        m.save(e.engine_id, chunks)
        assert m.stats().ssd_direct_writes == CHUNKS * NSEG  # one whole chunk per batch
        tier.flush()
        m.flush_dram()
        recs = {(o.key.chunk, o.key.layer, o.key.role): o for o in tier.iter_records()}
        payload = recs[(chunks[3].key, 2, Role.VALUE)]  # chunk 3: a payload byte (the GPU's CRC32C finds it)
        flip(path, payload.offset + 128 + 64 + 100)
        header = recs[(chunks[5].key, 0, Role.KEY)]  # chunk 5: its record header (the tier's check)
        flip(path, header.offset + 20)
        cmd.put("zero")
        reply.get(timeout=60)
        res = m.restore(e.engine_id, chunks)
        assert res.restored == [i not in (3, 5) for i in range(CHUNKS)]
        assert {x.key for x in res.misses} == {chunks[3].key, chunks[5].key}
        assert all(x.reason == "lower tier: record failed validation or could not be read" for x in res.misses)
        assert tier.snapshot().corrupt_records_total == 2
        assert not tier.contains(payload.key) and not tier.contains(header.key)
        assert m.stats().ssd_direct_reads == (CHUNKS - 2) * NSEG
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), dtype=np.uint16)
    want = np.frombuffer(original, dtype=np.uint16)
    for c in range(CHUNKS):
        if c in (3, 5):  # nothing written to a missed chunk's blocks, in any layer
            assert not _blocks_of(got, c).any()
        else:
            assert np.array_equal(_blocks_of(got, c), _blocks_of(want, c))


def test_direct_records_read_by_io_uring_and_inspect_after_recover(engine, tmp_path):
    from orbitkv_fs.tools.inspect import main as inspect

    cmd, reply, handle, original = engine
    d = direct_io_dir(tmp_path)
    path = str(d / "r.okv")
    tier = _tier([path])
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec="fp8", batch_segments=NSEG), lower_tier=tier) as m:
        e = m.register_engine(_registration(handle))
        m.save(e.engine_id, _chunks("recover-"))
        tier.flush()
        keys = [o.key for o in tier.iter_records()]
        assert len(keys) == m.stats().ssd_direct_writes > 0
        want = {k: m.read_object(k) for k in keys}  # the DRAM copies: the same segment bytes
    with _tier([path], backend="uring", recover=True) as t:
        assert t.snapshot().objects == len(keys)
        assert t.read_many(keys) == [want[k] for k in keys]
    assert inspect(["verify", path]) == 0
    with _tier([path], recover=True) as t:  # and the cuFile tier reads them back into device memory
        import cupy

        seen = {}

        def sink(batch):
            for i, v in batch:
                seen[keys[i]] = cupy.asnumpy(v).tobytes()

        assert t.read_many_device(keys, sink) == [None] * len(keys)
        assert seen == want
