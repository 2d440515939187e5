"""The Manager against GPU KV tensors imported through CUDA IPC from a second (engine) process.

The engine process allocates its KV with cudaMalloc, fills it and hands the Manager (this process) CUDA
IPC handles; the Manager saves through the GPU codec engine, the engine zeroes its KV, the Manager
restores, and the engine sends its KV back for a byte comparison (exact codecs) or an error bound
(lossy ones).
"""

from __future__ import annotations

import contextlib

import multiprocessing as mp

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.geometry import CudaIpcHandle, EngineRegistration, TensorDesc
from orbitkv_fs.keys import chunk_key, pack_key
from orbitkv_fs.manager import SKIP_BLOCK, ChunkBlocks, Manager, ManagerConfig, RequestError
from orbitkv_fs.manager.batching import EARLY_BATCHES
from orbitkv_fs.manager.device import _GpuCodecs, _run_of
from orbitkv_fs.segment import Role

pytestmark = pytest.mark.gpu

L, B, T, H, D = 6, 32, 16, 4, 128
SHAPE = (B, T, H, D)
NBYTES = int(np.prod(SHAPE)) * 2


def _engine_process(cmd, reply) -> None:
    import cupy

    mem = cupy.cuda.Memory(2 * L * NBYTES)  # one cudaMalloc: its IPC handle's base is mem.ptr
    flat = cupy.ndarray((2 * L * NBYTES // 2,), dtype=cupy.uint16, memptr=cupy.cuda.MemoryPointer(mem, 0))
    rng = np.random.default_rng(3)
    host = rng.standard_normal(flat.size, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    flat.set(host)
    cupy.cuda.runtime.deviceSynchronize()
    reply.put((bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)), host.tobytes()))
    while True:
        c = cmd.get()
        if c == "zero":
            flat.fill(0)
            cupy.cuda.runtime.deviceSynchronize()
            reply.put(None)
        elif c == "reset":  # back to the original KV (a lossy restore leaves its rounding in the pages)
            flat.set(host)
            cupy.cuda.runtime.deviceSynchronize()
            reply.put(None)
        elif c == "read":
            cupy.cuda.runtime.deviceSynchronize()
            reply.put(flat.get().tobytes())
        elif c == "read_now":  # what an engine does once restore answered: no wait for anyone's stream
            reply.put(flat.get().tobytes())
        else:
            return


@contextlib.contextmanager
def engine_process():
    """The engine process (:func:`_engine_process`): ``(cmd, reply, IPC handle, its KV bytes)``; stopped
    on exit."""
    ctx = mp.get_context("spawn")
    cmd, reply = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(cmd, reply))
    proc.start()
    try:
        handle, original = reply.get(timeout=120)
        yield cmd, reply, handle, original
    finally:
        cmd.put("stop")
        proc.join(60)


@pytest.fixture
def engine():
    """A fresh engine process per test (see :func:`engine_process`)."""
    with engine_process() as e:
        yield e


@pytest.mark.parametrize("codec", ["none", "ans", "fp8", "turboquant-4"])
def test_cuda_ipc_engine_round_trip(codec, engine):
    cmd, reply, handle, original = engine
    reg = _registration(handle)
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec)) as m:
        assert m.arena_info().pinned
        e = m.register_engine(reg)
        assert e.device == "cuda:0"
        chunks = [ChunkBlocks(chunk_key(f"g{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
        r = m.save(e.engine_id, chunks)
        assert r.segments == len(chunks) * 2 * L
        cmd.put("zero")
        reply.get(timeout=60)
        lk = m.lookup(e.engine_id, [c.key for c in chunks])
        assert lk.count == len(chunks)
        res = m.restore(e.engine_id, chunks, lease_id=lk.lease_id)
        assert all(res.restored), res.misses
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.workspace_bytes) == (0, 0, 0, 0, 0)
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), dtype=np.uint16)
    assert_restored(got, np.frombuffer(original, dtype=np.uint16), codec)


def assert_restored(got: np.ndarray, want: np.ndarray, codec: str) -> None:
    """Restored BF16 words against the originals: equal for exact codecs, within 12% RMS for lossy ones."""
    if codec in ("none", "ans"):
        assert np.array_equal(got, want)
    else:
        g = got.view(ml_dtypes.bfloat16).astype(np.float32)
        w = want.view(ml_dtypes.bfloat16).astype(np.float32)
        assert np.linalg.norm(g - w) < 0.12 * np.linalg.norm(w)


def _flip(m: Manager, ns: bytes, chunk: bytes, layer: int, role: Role, at: int, mask: int = 0x10) -> None:
    """Flip ``mask`` in byte ``at`` of a segment's arena extent (its 64-byte header, then its payload)."""
    (slot, gen, off, _), = m.dram.lease([pack_key(ns, chunk, layer, role)])
    m.dram.unlease([(slot, gen)])
    m.dram.view(off + at, 1)[0] ^= mask


def _early_config(codec: str) -> ManagerConfig:
    """A Manager whose restores of ``B // 2`` chunks start early: 2 chunks a batch (24 segments), a 4 MiB codec
    budget."""
    return ManagerConfig(pool_size=64 << 20, storage_codec=codec, storage_codec_budget=4 << 20, batch_segments=24)


def _registration(handle: bytes) -> EngineRegistration:
    strides = [T * H * D, H * D, D, 1]
    descs = [TensorDesc(layer=l, role=role, layout="separate", shape=list(SHAPE), strides=strides,
                        dtype="bfloat16", handle=CudaIpcHandle(handle, (2 * l + r) * NBYTES, 0, 2 * L * NBYTES))
             for l in range(L) for r, role in enumerate(("key", "value"))]
    return EngineRegistration(model="gpu-test", num_layers=L, layer_start=0, layer_end=L, block_size=T,
                              num_heads=H, head_dim=D, dtype="bfloat16", tensors=descs)


@pytest.mark.parametrize("codec", ["none", "fp8", "turboquant-4"])
def test_restored_pages_are_in_place_when_restore_answers(codec, engine):
    """The engine (another process) reads its KV the moment restore returns, without synchronising:
    every copy the Manager queued must have landed. Also checks the GPU engine's counters: one
    decode_batch per restore batch (batch_segments), not one per segment."""
    cmd, reply, handle, original = engine
    per_batch = 16
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, batch_segments=per_batch)) as m:
        e = m.register_engine(_registration(handle))
        chunks = [ChunkBlocks(chunk_key(f"r{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
        nseg = len(chunks) * 2 * L
        assert m.save(e.engine_id, chunks).segments == nseg
        cmd.put("zero")
        reply.get(timeout=60)
        assert all(m.restore(e.engine_id, chunks).restored)
        cmd.put("read")
        ref = reply.get(timeout=60)  # after a device-wide sync in the engine
        if codec == "none":
            assert ref == original
        for _ in range(5):
            cmd.put("zero")
            reply.get(timeout=60)
            assert all(m.restore(e.engine_id, chunks).restored)
            cmd.put("read_now")
            assert reply.get(timeout=60) == ref
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.workspace_bytes) == (0, 0, 0, 0, 0)
        # GPU pages: every segment, exact ones included, goes through the GPU engine both ways
        restores = 6
        assert st.gpu_segments["save"] + st.gpu_cpu_fallbacks["save"] == nseg
        assert st.gpu_cpu_fallbacks["restore"] == 0  # 32 KiB segments fit the workspace
        assert st.gpu_segments["restore"] == restores * nseg
        # batches of whole chunks: 16 segments would take 4 of a 12-segment chunk, a quarter of the batch, so each
        # batch is one chunk (batching.ALIGN_SHARE)
        assert 2 * L == 12 and per_batch == 16
        assert st.gpu_batches["restore"] == restores * len(chunks)
        assert st.gpu_workspace_bytes > 0 and st.gpu_workspace_grows >= 1
        if codec == "turboquant-4":  # the policy's exact layers are stored raw, with their reason
            assert st.codec_segments.get("raw", 0) == len(chunks) * 2 * len(e.exact_layers)


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_corrupt_arena_segment_is_a_miss_on_gpu_pages(codec, engine):
    """Payload CRC32Cs of segments bound for GPU pages are checked on the GPU: a flipped payload byte in
    the arena makes its chunk a miss, its destination blocks keep what they held, every other chunk is
    restored exactly as saved."""
    cmd, reply, handle, _ = engine
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec)) as m:
        e = m.register_engine(_registration(handle))
        chunks = [ChunkBlocks(chunk_key(f"c{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
        m.save(e.engine_id, chunks)
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16)
        victim = chunks[3]
        _flip(m, m._engines[e.engine_id].ns, victim.key, 2, Role.VALUE, 64 + 100, 0x40)  # a payload byte
        cmd.put("zero")
        reply.get(timeout=60)
        res = m.restore(e.engine_id, chunks)
        assert res.restored == [i != 3 for i in range(len(chunks))]
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        want = saved.reshape(2 * L, B, T * H * D)
        for i, ch in enumerate(chunks):
            for b in ch.blocks:
                if i == 3:
                    assert not got[2 * 2 + 1, b].any()  # the corrupt segment wrote nothing
                elif codec == "none":
                    assert np.array_equal(got[:, b], want[:, b])
        assert m.stats().decode_failures >= 1


@pytest.mark.parametrize("codec", ["none", "turboquant-4"])
def test_corrupt_headers_are_misses_and_a_wrong_size_fails_on_gpu_pages(codec, engine):
    """Headers of segments bound for GPU pages are verified batch by batch during the restore: a header
    whose CRC32C fails (a flipped reserved byte, found only by the full check) and one whose length field
    was changed (the up-front size check sees it and verifies at once) make their chunks misses, not
    request errors; their destination blocks keep what they held, and the other chunks are restored over
    many batches (turboquant-4 mixes its exact and quantised layers in them). A request whose blocks
    cannot hold a segment is a RequestError with nothing written."""
    cmd, reply, handle, original = engine
    chunks = [ChunkBlocks(chunk_key(f"h{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, storage_codec_budget=4 << 20,
                               batch_segments=8)) as m:
        e = m.register_engine(_registration(handle))
        m.save(e.engine_id, chunks)
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        ns = m._engines[e.engine_id].ns
        for ci, layer, role, at in ((5, 3, Role.KEY, 40), (9, 1, Role.VALUE, 17)):
            _flip(m, ns, chunks[ci].key, layer, role, at)  # byte 40: reserved; byte 17: the original length
        cmd.put("zero")
        reply.get(timeout=60)
        with pytest.raises(RequestError):
            m.restore(e.engine_id, [ChunkBlocks(chunks[0].key, [0, 1, 2])])
        cmd.put("read")
        assert not np.frombuffer(reply.get(timeout=60), np.uint16).any()  # the refused request wrote nothing
        before = m.stats().decode_failures
        res = m.restore(e.engine_id, chunks)
        assert res.restored == [i not in (5, 9) for i in range(len(chunks))]
        assert {x.key for x in res.misses} == {chunks[5].key, chunks[9].key}
        assert all(x.reason.startswith("corrupt") for x in res.misses), res.misses
        assert m.stats().decode_failures == before + 2
        assert m._gpu_codecs.stats()["restore_batches"] >= 8
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        for b in chunks[5].blocks:
            assert not got[2 * 3, b].any()
        for b in chunks[9].blocks:
            assert not got[2 * 1 + 1, b].any()
        keep = [b for i, ch in enumerate(chunks) if i not in (5, 9) for b in ch.blocks]
        assert_restored(got[:, keep], saved[:, keep], codec)
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.workspace_bytes) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("codec", ["none", "ans", "fp8", "turboquant-4"])
def test_shuffled_blocks_over_pipelined_batches(codec, engine):
    """Chunks of shuffled block ids (gathered and scattered by the block-copy kernel) over a dozen small
    batches, two in flight on each worker: the restore equals the save, is in place when restore answers,
    and every reservation returns to zero."""
    cmd, reply, handle, original = engine
    order = np.random.default_rng(7).permutation(B).tolist()
    chunks = [ChunkBlocks(chunk_key(f"s{i}"), order[4 * i:4 * i + 4]) for i in range(B // 4)]
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, storage_codec_budget=4 << 20,
                               batch_segments=8)) as m:
        e = m.register_engine(_registration(handle))
        r = m.save(e.engine_id, chunks)
        assert r.segments == len(chunks) * 2 * L
        cmd.put("zero")
        reply.get(timeout=60)
        res = m.restore(e.engine_id, chunks)
        assert all(res.restored), res.misses
        cmd.put("read_now")  # restore answered: the engine reads at once
        got = np.frombuffer(reply.get(timeout=60), dtype=np.uint16)
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.workspace_bytes) == (0, 0, 0, 0, 0)
        counters = m._gpu_codecs.stats()
        assert counters["save_batches"] >= 12 and counters["restore_batches"] >= 12
        moved = sum(len(c.blocks) for c in chunks if _run_of(c.blocks) is None) * 2 * L  # runs need no copy
        assert moved and counters["save_block_copies"] == counters["restore_block_copies"] == moved
    assert_restored(got, np.frombuffer(original, dtype=np.uint16), codec)


@pytest.mark.parametrize("codec", ["none", "fp8", "turboquant-4"])
def test_skip_positions_are_not_written_on_gpu_pages(codec, engine):
    """SKIP_BLOCK positions of a restore on GPU pages: the chunk's other positions land in their blocks
    (through the staged temporary and the block-copy kernel: a chunk with a skip is never a direct run),
    and the skipped blocks, like every block not named, keep what they held."""
    cmd, reply, handle, _ = engine
    S = SKIP_BLOCK
    chunks = [ChunkBlocks(chunk_key(f"k{i}"), list(range(4 * i, 4 * i + 4))) for i in range(3)]
    plan = [ChunkBlocks(chunks[0].key, [S, S, 2, 3]), ChunkBlocks(chunks[1].key, [4, 5, 6, S]),
            ChunkBlocks(chunks[2].key, [S, 20, S, 21])]
    want = {2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 20: 9, 21: 11}  # written block: saved block of that position
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, batch_segments=8)) as m:
        e = m.register_engine(_registration(handle))
        assert m.save(e.engine_id, chunks).segments == 3 * 2 * L
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        cmd.put("zero")
        reply.get(timeout=60)
        assert m.restore(e.engine_id, plan).restored == [True] * 3
        cmd.put("read_now")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        assert_restored(got[:, list(want)], saved[:, list(want.values())], codec)
        assert not got[:, [b for b in range(B) if b not in want]].any()
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)


@pytest.mark.parametrize("codec", ["none", "fp8", "turboquant-4", "ans"])
def test_restore_as_arrays_mixes_runs_and_shuffled_chunks_and_fails_per_chunk(codec, engine, monkeypatch):
    """A restore whose segments are all in DRAM is decoded as arrays (``decode_rows_submit``: no item per
    segment): chunks whose blocks are a run decode straight into their pages (but ANS ones, which nvCOMP
    writes in place into the temporary), shuffled ones through the temporary and the block-copy kernel, in
    the same batches. A flipped reserved header byte (found only by a batch's header check) and a flipped
    payload byte (found by the GPU's CRC32C; for ANS one in a bitstream, decompressed all the same) make
    their chunks misses with those segments' blocks untouched; every other chunk equals the save."""
    cmd, reply, handle, _ = engine
    runs = [list(range(8 * i, 8 * i + 4)) for i in range(4)]
    rest = [b for b in range(B) if all(b not in r for r in runs)]
    np.random.default_rng(11).shuffle(rest)
    shuffled = [rest[4 * i:4 * i + 4] for i in range(4)]
    chunks = [ChunkBlocks(chunk_key(f"m{i}"), (runs if i % 2 == 0 else shuffled)[i // 2]) for i in range(8)]
    started = []
    real = _GpuCodecs.decode_rows_submit

    def spy(self, *args, **kwargs):
        db = real(self, *args, **kwargs)
        started.append(db is not None)
        return db

    monkeypatch.setattr(_GpuCodecs, "decode_rows_submit", spy)
    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec=codec, storage_codec_budget=4 << 20,
                               batch_segments=16)) as m:
        e = m.register_engine(_registration(handle))
        assert m.save(e.engine_id, chunks).segments == len(chunks) * 2 * L
        if codec == "ans":
            assert m.stats().codec_segments.get("ans", 0) == len(chunks) * 2 * L
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        ns = m._engines[e.engine_id].ns
        for ci, layer, role, at in ((2, 1, Role.KEY, 40), (5, 4, Role.VALUE, 64 + 1000)):
            _flip(m, ns, chunks[ci].key, layer, role, at)  # byte 40: reserved (header); 1064: payload
        cmd.put("zero")
        reply.get(timeout=60)
        before = m.stats().decode_failures
        res = m.restore(e.engine_id, chunks)
        assert res.restored == [i not in (2, 5) for i in range(len(chunks))], res.misses
        assert len(started) >= 6 and all(started)  # every batch went through the arrays path
        assert m.stats().decode_failures == before + 2
        cmd.put("read_now")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        assert not got[2 * 1, chunks[2].blocks].any() and not got[2 * 4 + 1, chunks[5].blocks].any()
        keep = [b for i, ch in enumerate(chunks) if i not in (2, 5) for b in ch.blocks]
        assert_restored(got[:, keep], saved[:, keep], codec)
        assert m._gpu_codecs.stats()["restore_block_copies"] > 0
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)


def _spy_rows_submit(monkeypatch) -> list:
    """Each ``decode_rows_submit`` call's ``direct`` argument, in order (False: the early first batch)."""
    calls: list = []
    real = _GpuCodecs.decode_rows_submit

    def spy(self, *args, direct=True, **kwargs):
        calls.append(direct)
        return real(self, *args, direct=direct, **kwargs)

    monkeypatch.setattr(_GpuCodecs, "decode_rows_submit", spy)
    return calls


@pytest.mark.parametrize("codec,wrong_at", [("none", -1), ("turboquant-4", -1), ("fp8", 3)])
def test_early_first_batch_writes_nothing_when_the_rest_is_refused(codec, wrong_at, engine, monkeypatch):
    """A restore's first batches (EARLY_BATCHES, a part of the request's chunks each) start before the rest of
    the request is leased and checked. When a later chunk's blocks cannot hold its segments (a RequestError
    found only in that check: in the rest, or in the second part, whose batch then never starts), the request
    fails with nothing written, also to the early batches' chunks (runs of blocks, which the usual path decodes
    straight into their pages), and every lease, reservation and workspace byte is back."""
    cmd, reply, handle, _ = engine
    chunks = [ChunkBlocks(chunk_key(f"e{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
    calls = _spy_rows_submit(monkeypatch)
    with Manager(_early_config(codec)) as m:
        e = m.register_engine(_registration(handle))
        m.save(e.engine_id, chunks)
        cmd.put("zero")
        reply.get(timeout=60)
        wrong = list(chunks)
        wrong[wrong_at] = ChunkBlocks(chunks[wrong_at].key, chunks[wrong_at].blocks[:1])  # saved from two blocks
        with pytest.raises(RequestError):
            m.restore(e.engine_id, wrong)
        # 2 chunks a batch: the parts [0, 2) and [2, 4) start early, unless the wrong chunk is in one
        assert calls == [False] * (EARLY_BATCHES if wrong_at == -1 else 1)
        cmd.put("read")
        assert not np.frombuffer(reply.get(timeout=60), np.uint16).any()
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)
        calls.clear()
        res = m.restore(e.engine_id, chunks)  # the same request, right: the early batches, then the rest
        assert all(res.restored), res.misses
        assert calls[:EARLY_BATCHES] == [False] * EARLY_BATCHES and len(calls) > EARLY_BATCHES
        assert all(calls[EARLY_BATCHES:])
        cmd.put("read_now")
        got = np.frombuffer(reply.get(timeout=60), np.uint16)
        cmd.put("reset")
        reply.get(timeout=60)
        cmd.put("read")
        assert_restored(got, np.frombuffer(reply.get(timeout=60), np.uint16), codec)


@pytest.mark.parametrize("codec", ["none", "turboquant-4"])
def test_early_batches_with_corrupt_segments(codec, engine, monkeypatch):
    """A corrupt header in the second early part keeps that part's batch from starting early (the usual batches
    verify it and make its chunk a miss, nothing of it written); a corrupt payload in the first early batch is
    found by the GPU's CRC32C check, its chunk is a miss and that segment's blocks keep what they held (the
    early batch decodes into its temporary, and only rows that passed are scattered). Every other chunk is
    restored as saved, and every lease, reservation and workspace byte is back."""
    cmd, reply, handle, _ = engine
    chunks = [ChunkBlocks(chunk_key(f"x{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
    calls = _spy_rows_submit(monkeypatch)
    with Manager(_early_config(codec)) as m:
        e = m.register_engine(_registration(handle))
        m.save(e.engine_id, chunks)
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        ns = m._engines[e.engine_id].ns
        # 2 chunks a batch: chunk 1 in the first early part, chunk 3 in the second
        for ci, layer, role, at in ((1, 2, Role.VALUE, 64 + 100), (3, 4, Role.KEY, 40)):
            _flip(m, ns, chunks[ci].key, layer, role, at)  # a payload byte; byte 40 of the header: reserved
        cmd.put("zero")
        reply.get(timeout=60)
        before = m.stats().decode_failures
        res = m.restore(e.engine_id, chunks)
        assert res.restored == [i not in (1, 3) for i in range(len(chunks))], res.misses
        assert calls[0] is False and len(calls) > 1 and all(calls[1:])  # the second part's batch: not early
        assert m.stats().decode_failures == before + 2
        cmd.put("read")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        assert not got[2 * 2 + 1, chunks[1].blocks].any() and not got[:, chunks[3].blocks].any()
        keep = [b for i, ch in enumerate(chunks) if i not in (1, 3) for b in ch.blocks]
        assert_restored(got[:, keep], saved[:, keep], codec)
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_early_first_batch_is_dropped_when_the_rest_is_not_all_in_dram(codec, engine, monkeypatch):
    """When the rest of a request is not all in DRAM (a chunk never saved), the restore cannot go as arrays:
    the early first batch is ended unused and the usual path restores the request, the first chunks included;
    the missing chunk is a miss and its blocks keep what they held."""
    cmd, reply, handle, _ = engine
    chunks = [ChunkBlocks(chunk_key(f"d{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2 - 1)]
    calls = _spy_rows_submit(monkeypatch)
    with Manager(_early_config(codec)) as m:
        e = m.register_engine(_registration(handle))
        m.save(e.engine_id, chunks)
        cmd.put("read")
        saved = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        cmd.put("zero")
        reply.get(timeout=60)
        never = ChunkBlocks(chunk_key("never-saved"), [B - 2, B - 1])
        res = m.restore(e.engine_id, chunks + [never])
        assert res.restored == [True] * len(chunks) + [False]
        assert calls == [False] * EARLY_BATCHES  # started early, then dropped: the items path took every batch
        cmd.put("read_now")
        got = np.frombuffer(reply.get(timeout=60), np.uint16).reshape(2 * L, B, T * H * D)
        keep = [b for ch in chunks for b in ch.blocks]
        assert_restored(got[:, keep], saved[:, keep], codec)
        assert not got[:, never.blocks].any()
        st = m.stats()
        assert (st.reserved_bytes, st.leases_active, st.workspace_bytes) == (0, 0, 0)
