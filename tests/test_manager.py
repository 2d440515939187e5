"""Manager end to end on host engine pages: every host codec, eviction, leases, validation, reservations."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import (
    ChunkBlocks,
    EngineRegistration,
    LeaseError,
    Manager,
    ManagerConfig,
    SKIP_BLOCK,
    RequestError,
    UnknownEngine,
)
from orbitkv_fs.pages import host_engine_pages
from orbitkv_fs.segment import HEADER_SIZE, Role

L, B, T, H, D = 6, 64, 16, 2, 64
BLOCK_BYTES = T * H * D * 2  # one block of one role of one layer, bf16


def make_engine(layout: str = "separate", *, num_layers: int = L, num_blocks: int = B, **reg_kw):
    pages, descs = host_engine_pages(num_layers=num_layers, num_blocks=num_blocks, block_size=T, num_heads=H,
                                     head_dim=D, layout=layout)
    rng = np.random.default_rng(7)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = (rng.standard_normal(a.shape) * 2).astype(ml_dtypes.bfloat16)
    reg = EngineRegistration(model="test-model", num_layers=num_layers, layer_start=0, layer_end=num_layers,
                             block_size=T, num_heads=H, head_dim=D, dtype="bfloat16", tensors=descs, **reg_kw)
    return pages, reg


@pytest.fixture
def engine():
    pages, reg = make_engine()
    yield pages, reg
    pages.close()


def snapshot(pages):
    return {n: pages.array(n).copy() for n in pages.tensors}


def zero(pages):
    for n in pages.tensors:
        pages.array(n)[...] = 0


def chunks_for(n: int, per: int = 2, base: int = 0, salt: str = "c"):
    return [ChunkBlocks(chunk_key(f"{salt}{i}"), list(range(base + per * i, base + per * (i + 1)))) for i in range(n)]


def assert_reservations_zero(m: Manager) -> None:
    st = m.stats()
    assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes, st.workspace_bytes,
            st.inflight_requests) == (0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("codec", ["none", "fp8", "turboquant-4", "turboquant-3"])
def test_save_evict_lookup_restore_every_codec(engine, codec):
    pages, reg = engine
    orig = snapshot(pages)
    # 8 chunks x 6 layers x 2 roles x 2 blocks x 4 KiB: 768 KiB logical; the pool holds about 1.6 chunks.
    pool = {"none": 168, "fp8": 90, "turboquant-4": 128, "turboquant-3": 128}[codec] << 10
    with Manager(ManagerConfig(pool_size=pool, storage_codec=codec)) as m:
        e = m.register_engine(reg)
        first, second = chunks_for(4), chunks_for(4, base=8, salt="d")
        r = m.save(e.engine_id, first)
        assert r.dropped_segments == 0
        m.save(e.engine_id, second)  # evicts most of ``first``
        st = m.stats()
        assert st.evictions > 0 and st.pool_used_bytes <= st.pool_capacity_bytes
        assert m.lookup(e.engine_id, [c.key for c in first], lease=False).count < 4
        lk = m.lookup(e.engine_id, [c.key for c in second[-1:]])
        assert lk.count == 1 and lk.lease_id
        zero(pages)
        res = m.restore(e.engine_id, second[-1:], lease_id=lk.lease_id)
        assert res.restored == [True] and not res.misses
        with pytest.raises(LeaseError):
            m.release(lk.lease_id)  # the restore released it
        blocks = second[-1].blocks
        for name in pages.tensors:
            got = pages.array(name)[blocks].astype(np.float32)
            want = orig[name][blocks].astype(np.float32)
            layer = int(name.split(".")[0][1:])
            if codec == "none" or (codec.startswith("turboquant") and (layer < 2 or layer >= L - 2)):
                assert np.array_equal(pages.array(name)[blocks].view(np.uint16), orig[name][blocks].view(np.uint16))
            elif codec == "fp8":
                assert np.all(np.abs(got - want) <= np.abs(want) / 16 + 2.0 ** -9)  # E4M3: 3 mantissa bits
            else:
                rel = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert rel < (0.12 if codec == "turboquant-4" else 0.22), rel
            untouched = [b for b in range(B) if b not in blocks]
            assert not pages.array(name)[untouched].view(np.uint16).any()
        st = m.stats()
        assert st.codec_segments and st.restore_requests == 1
        if codec.startswith("turboquant"):
            assert st.raw_segments.get("policy", 0) > 0 and st.codec_segments.get("turboquant", 0) > 0
        assert_reservations_zero(m)


def test_lossy_codec_keeps_out_of_range_raw(engine):
    pages, reg = engine
    pages.array("L3.key")[5] = 1000.0  # beyond E4M3's 448: never clipped, the segment stays raw
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=8 << 20, storage_codec="fp8")) as m:
        e = m.register_engine(reg)
        ch = [ChunkBlocks(chunk_key("x"), [4, 5])]
        r = m.save(e.engine_id, ch)
        assert r.raw_segments == {"out_of_range": 1}
        zero(pages)
        assert m.restore(e.engine_id, ch).restored == [True]
        assert np.array_equal(pages.array("L3.key")[[4, 5]].view(np.uint16), orig["L3.key"][[4, 5]].view(np.uint16))


@pytest.mark.parametrize("layout", ["vllm_packed", "sglang_token_pool", "mla"])
def test_layouts_round_trip_exact(layout):
    pages, reg = make_engine(layout, attention="mla" if layout == "mla" else "gqa")
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=8 << 20, storage_codec="turboquant-4")) as m:
            e = m.register_engine(reg)
            expect = {"vllm_packed": 2 * L, "sglang_token_pool": 2 * L, "mla": L}[layout]
            assert e.segments_per_chunk == expect
            if layout == "mla":
                assert e.exact_layers == list(range(L))
            ch = chunks_for(3)
            m.save(e.engine_id, ch)
            zero(pages)
            assert m.restore(e.engine_id, ch).restored == [True] * 3
            for name in pages.tensors:
                a, b = pages.array(name), orig[name]
                if layout == "sglang_token_pool":
                    a, b = a[: 6 * T], b[: 6 * T]
                else:
                    a, b = a[:6], b[:6]
                layer = int(name.split(".")[0][1:])
                if layout == "mla" or layer < 2 or layer >= L - 2:
                    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), name
                else:
                    assert np.linalg.norm(a.astype(np.float32) - b.astype(np.float32)) < \
                        0.12 * np.linalg.norm(b.astype(np.float32))
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_leases_block_eviction(engine):
    pages, reg = engine
    seg = HEADER_SIZE + 2 * BLOCK_BYTES
    per_chunk = 2 * L * ((seg + 511) // 512 * 512)
    # Pins may hold the whole pool here (max_pinned_share 1): a's two chunks are two thirds of it, past the
    # default share (tests/test_pin_share.py).
    with Manager(ManagerConfig(pool_size=3 * per_chunk, max_pinned_share=1.0)) as m:
        e = m.register_engine(reg)
        a = chunks_for(2, salt="a")
        m.save(e.engine_id, a)
        lk = m.lookup(e.engine_id, [c.key for c in a])
        assert lk.count == 2
        b = chunks_for(3, base=8, salt="b")
        m.save(e.engine_id, b)  # one chunk of room left: b's segments evict each other, never a's
        assert m.lookup(e.engine_id, [c.key for c in a], lease=False).count == 2
        lk_b = m.lookup(e.engine_id, [b[-1].key])
        assert lk_b.count == 1  # now every byte of the pool is leased
        r = m.save(e.engine_id, chunks_for(1, base=20, salt="z"))
        assert r.dropped_segments == 2 * L and r.segments == 0
        m.release(lk_b.lease_id)
        keys = [ObjectKey(bytes.fromhex(e.namespace), a[0].key, 0, Role.KEY)]
        lid, ext = m.lease_objects(keys)
        assert ext[0] is not None and ext[0].length == seg
        m.release(lk.lease_id)
        m.save(e.engine_id, chunks_for(3, base=8, salt="c"))
        assert m.lookup(e.engine_id, [a[1].key], lease=False).count == 0  # unleased: evicted now
        view = m.dram.view(ext[0].offset, ext[0].length).tobytes()
        assert m.read_object(keys[0]) == view  # the object leased by key survived
        m.release(lid)
        assert_reservations_zero(m)


def test_restore_validation_writes_nothing(engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(3)
        m.save(e.engine_id, ch)
        zero(pages)
        bad = [ch[0], ChunkBlocks(ch[1].key, [10, B + 5])]
        with pytest.raises(RequestError, match="unknown block"):
            m.restore(e.engine_id, bad)
        with pytest.raises(RequestError, match="destination blocks take"):  # wrong size: 3 blocks for 2
            m.restore(e.engine_id, [ch[0], ChunkBlocks(ch[1].key, [10, 11, 12])])
        with pytest.raises(RequestError, match="16 bytes"):
            m.restore(e.engine_id, [ChunkBlocks(b"short", [1])])
        with pytest.raises(UnknownEngine):
            m.restore("nope", ch)
        for name in pages.tensors:
            assert not pages.array(name).view(np.uint16).any(), name
        assert_reservations_zero(m)


@pytest.mark.parametrize("layout,codec", [("separate", "none"), ("vllm_packed", "none"), ("sglang_token_pool", "none"),
                                          ("vllm_packed", "fp8")])
def test_skip_block_positions_are_read_but_not_written(layout, codec, tmp_path):
    """A restore may leave positions of a multi-block chunk unwritten (SKIP_BLOCK): an engine that holds a
    chunk's first blocks already loads only the rest. The other positions get their own part of the
    segment, embedded and over the data plane; a chunk of skips only, and a skip in a save, are refused."""
    from orbitkv_fs.dataplane import DataPlaneServer, RemoteClient

    pages, reg = make_engine(layout)
    S = SKIP_BLOCK
    rows = (lambda b: slice(b * T, (b + 1) * T)) if layout == "sglang_token_pool" else (lambda b: b)  # block b
    try:
        orig = snapshot(pages)
        with Manager(ManagerConfig(pool_size=8 << 20, storage_codec=codec)) as m:
            e = m.register_engine(reg)
            saved = chunks_for(2, per=4)  # blocks 0-3 and 4-7
            assert m.save(e.engine_id, saved).chunks_saved == 2
            with pytest.raises(RequestError, match="unknown block"):
                m.save(e.engine_id, [ChunkBlocks(chunk_key("s"), [S, 9])])
            # position p of chunk c holds block 4c+p; written to the block named at that position
            plan = [ChunkBlocks(saved[0].key, [S, S, 20, 21]), ChunkBlocks(saved[1].key, [30, S, 31, S])]
            want = {20: 2, 21: 3, 30: 4, 31: 6}
            srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock")
            remote = RemoteClient(srv.endpoint, timeout=30)
            remote.set_credential(e.engine_id, e.credential)  # registered in-process, restored over the wire
            try:
                for restore in (m.restore, remote.restore):
                    zero(pages)
                    assert restore(e.engine_id, plan).restored == [True, True]
                    for name in pages.tensors:
                        got, ref = pages.array(name), orig[name]
                        for dst, src in want.items():
                            if codec == "none":
                                assert np.array_equal(got[rows(dst)].view(np.uint16), ref[rows(src)].view(np.uint16))
                            else:
                                a, b = got[rows(dst)].astype(np.float32), ref[rows(src)].astype(np.float32)
                                assert np.all(np.abs(a - b) <= np.abs(b) / 16 + 2.0 ** -9), (name, dst)
                        untouched = [b for b in range(B) if b not in want]
                        assert not any(got[rows(b)].view(np.uint16).any() for b in untouched), name
                    zero(pages)
                    with pytest.raises(RequestError, match="SKIP_BLOCK"):
                        restore(e.engine_id, [plan[0], ChunkBlocks(saved[1].key, [S] * 4)])
                    with pytest.raises(RequestError, match="destination blocks take"):  # skips still count
                        restore(e.engine_id, [ChunkBlocks(saved[0].key, [S, 20, 21])])
                    assert not any(pages.array(n).view(np.uint16).any() for n in pages.tensors)
            finally:
                remote.close()
                srv.close()
            assert_reservations_zero(m)
    finally:
        pages.close()


def test_restore_with_another_engines_lease_is_refused(engine):
    pages, reg = engine
    other_pages, other = make_engine()  # one piece of memory is held by one engine only
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        a = m.register_engine(reg)
        b = m.register_engine(other)
        ch = chunks_for(1)
        m.save(a.engine_id, ch)
        lk = m.lookup(a.engine_id, [ch[0].key])
        with pytest.raises(LeaseError):
            m.restore(b.engine_id, ch, lease_id=lk.lease_id)
        assert m.restore(a.engine_id, ch, lease_id=lk.lease_id).restored == [True]
        assert_reservations_zero(m)
    other_pages.close()


@pytest.mark.parametrize("layer, offset, error", [
    (4, HEADER_SIZE + 100, "PayloadChecksumMismatch"),
    (L - 1, HEADER_SIZE + 100, "PayloadChecksumMismatch"),
    (L - 1, 13, "HeaderChecksumMismatch"),  # the layer field's high byte
    (L - 1, 61, "HeaderChecksumMismatch"),  # the header's own CRC
], ids=["payload", "payload-last-segment", "header", "header-crc"])
@pytest.mark.parametrize("window", ["whole", "per-chunk"])
def test_corrupt_segment_is_a_miss(engine, layer, offset, error, window, monkeypatch):
    """A flipped payload, header or header-CRC byte of one segment (exact segments of host pages are checked
    a batch at a time, their payloads a window of chunks at a time: all three, or one each) is a miss for its
    chunk, none of whose blocks is written; the other chunks restore."""
    if window == "per-chunk":
        from orbitkv_fs.manager import hostpath

        monkeypatch.setattr(hostpath, "_WINDOW_BYTES", 1)
    pages, reg = engine
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(3)
        m.save(e.engine_id, ch)
        key = ObjectKey(bytes.fromhex(e.namespace), ch[1].key, layer, Role.VALUE)
        lid, (ext,) = m.lease_objects([key])
        m.dram.view(ext.offset + offset, 1)[0] ^= 0x10  # flip a bit in the arena
        m.release(lid)
        zero(pages)
        res = m.restore(e.engine_id, ch)
        assert res.restored == [True, False, True]
        assert res.misses[0].key == ch[1].key and error in res.misses[0].reason
        assert res.segments == 2 * 2 * L and m.stats().decode_failures == 1
        for name in pages.tensors:
            a = pages.array(name).view(np.uint16)
            assert np.array_equal(a[[0, 1, 4, 5]], orig[name][[0, 1, 4, 5]].view(np.uint16))
            assert not a[[2, 3]].any()  # the corrupt chunk: nothing written
        assert_reservations_zero(m)


def test_invalidate_flush_and_listing(engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(4)
        m.save(e.engine_id, ch)
        ns = bytes.fromhex(e.namespace)
        page = m.list_objects(ns, limit=10)
        assert len(page.objects) == 10 and page.next_cursor
        rest = m.list_objects(ns, limit=1000, cursor=page.next_cursor)
        assert len(rest.objects) == 4 * 2 * L - 10 and rest.next_cursor is None
        assert len(m.list_objects(ns, prefix=ch[0].key.hex()[:6]).objects) == 2 * L
        for bad in ("dram:zz", "dram:abc", "disk:00", "lower:zz", "lower:abc"):  # a cursor this listing did not make
            with pytest.raises(RequestError):
                m.list_objects(ns, cursor=bad)
        r = m.invalidate(engine_id=e.engine_id, chunks=[ch[0].key])
        assert r.dram.objects == 2 * L and r.dram.bytes > 0
        lk = m.lookup(e.engine_id, [ch[1].key])
        r = m.invalidate(namespace=ns)
        assert r.dram.objects == 3 * 2 * L
        zero(pages)
        assert m.restore(e.engine_id, [ch[1]], lease_id=lk.lease_id).restored == [False]
        m.save(e.engine_id, ch)
        f = m.flush_dram()  # no lower tier: everything is dropped
        assert f.dropped.objects == 4 * 2 * L and m.stats().pool_used_bytes == 0
        with pytest.raises(RequestError):
            m.invalidate()
        assert_reservations_zero(m)


def test_threads_save_and_restore_concurrently(engine):
    pages, reg = engine
    orig = snapshot(pages)
    errors: list[BaseException] = []
    with Manager(ManagerConfig(pool_size=256 << 10, eviction="s3fifo")) as m:
        e = m.register_engine(reg)

        def worker(t: int) -> None:
            try:
                mine = [ChunkBlocks(chunk_key(f"t{t}-{i}"), [t * 16 + i]) for i in range(16)]
                for rnd in range(4):
                    m.save(e.engine_id, mine)
                    lk = m.lookup(e.engine_id, [c.key for c in mine])
                    res = m.restore(e.engine_id, mine[: lk.count], lease_id=lk.lease_id)
                    assert all(res.restored)
            except BaseException as ex:  # surfaced below
                errors.append(ex)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for name in pages.tensors:  # restores wrote back exactly what each block held
            assert np.array_equal(pages.array(name).view(np.uint16), orig[name].view(np.uint16))
        assert m.stats().evictions > 0
        assert_reservations_zero(m)


def test_unregister_waits_and_releases(engine):
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(2)
        m.save(e.engine_id, ch)
        m.lookup(e.engine_id, [c.key for c in ch])  # a lease the engine never releases
        started = threading.Event()
        gate = threading.Event()
        real_write = m._write_host_batch  # exact segments of host pages are written a batch at a time

        def slow_write(*a, **kw):
            started.set()
            gate.wait(5)
            return real_write(*a, **kw)

        m._write_host_batch = slow_write  # fault injection: hold a restore in flight
        t = threading.Thread(target=m.restore, args=(e.engine_id, ch))
        t.start()
        started.wait(5)
        done = threading.Event()
        u = threading.Thread(target=lambda: (m.unregister_engine(e.engine_id), done.set()))
        u.start()
        assert not done.wait(0.3)  # waiting for the restore
        with pytest.raises(UnknownEngine):
            m.save(e.engine_id, ch)  # closing: no new work
        gate.set()
        t.join()
        u.join()
        assert done.is_set() and m.list_engines() == []
        assert_reservations_zero(m)
        assert m.stats().resident_objects["dram"] == 2 * 2 * L  # objects outlive the engine


class _PeerManagers:
    """Another Manager in this process as the peer (the real transport is the peers part's); ``corrupt``
    flips a payload byte of what it serves (fault injection)."""

    def __init__(self, other: Manager, corrupt: bool = False) -> None:
        self.other = other
        self.corrupt = corrupt

    def fetch(self, keys):
        out = {}
        for k in keys:
            blob = self.other.read_object(k)
            if blob is not None:
                if self.corrupt:
                    blob = blob[:HEADER_SIZE] + bytes([blob[HEADER_SIZE] ^ 1]) + blob[HEADER_SIZE + 1:]
                out[k] = blob
        return out

    def lookup_prefix(self, namespace, chunks, layers):
        n = 0
        for c in chunks:
            if not all(self.other.read_object(ObjectKey(namespace, c, l, Role(r))) for l, r in layers):
                break
            n += 1
        return n


@pytest.mark.parametrize("corrupt", [False, True])
def test_peer_fetch_on_local_miss(engine, corrupt):
    pages, reg = engine
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=8 << 20)) as remote, Manager(ManagerConfig(pool_size=8 << 20)) as local:
        ch = chunks_for(2)
        remote.save(remote.register_engine(reg).engine_id, ch)
        e = local.register_engine(reg)
        local.set_peer_fetcher(_PeerManagers(remote, corrupt))
        lk = local.lookup(e.engine_id, [c.key for c in ch])
        assert (lk.count, lk.peer, lk.dram) == (2, 2, 0)
        zero(pages)
        res = local.restore(e.engine_id, ch, lease_id=lk.lease_id)
        if corrupt:  # the CRC catches it: a miss, nothing admitted
            assert res.restored == [False, False] and "PayloadChecksumMismatch" in res.misses[0].reason
            assert local.stats().resident_objects["dram"] == 0
        else:
            assert res.restored == [True, True] and local.stats().hits["peer"] == 2 * 2 * L
            for name in pages.tensors:
                assert np.array_equal(pages.array(name)[:4].view(np.uint16), orig[name][:4].view(np.uint16))
            assert local.lookup(e.engine_id, [ch[0].key], lease=False).dram == 1  # admitted locally
        assert_reservations_zero(local)


def test_restore_of_chosen_layers_writes_only_those(engine, tmp_path):
    """An engine loading layer by layer restores one layer per call: only that layer's pages are written,
    embedded and over the data plane; a layer the engine does not have is refused before anything is."""
    from orbitkv_fs.dataplane import DataPlaneServer, RemoteClient

    pages, reg = engine
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        ch = chunks_for(3)
        m.save(e.engine_id, ch)
        srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock")
        remote = RemoteClient(srv.endpoint, timeout=30)
        remote.set_credential(e.engine_id, e.credential)  # registered in-process, restored over the wire
        try:
            for restore in (m.restore, remote.restore):
                zero(pages)
                r = restore(e.engine_id, ch, layers=[2])
                assert r.restored == [True] * 3
                for name, t in pages.tensors.items():
                    got = pages.array(name)
                    if t.layer == 2:
                        assert np.array_equal(got[:6].view(np.uint16), orig[name][:6].view(np.uint16)), name
                    else:
                        assert not got.view(np.uint16).any(), name
                zero(pages)
                for bad in ([L], [], [0, -1]):
                    with pytest.raises(RequestError, match="layers"):
                        restore(e.engine_id, ch, layers=bad)
                for name in pages.tensors:
                    assert not pages.array(name).view(np.uint16).any(), name
        finally:
            remote.close()
            srv.close()
        assert_reservations_zero(m)


def _fail_at(monkeypatch, owner, name: str, at: int, what: str) -> None:
    """Make ``owner.name`` raise ``RuntimeError(what)`` on its ``at``-th call (1-based): an injected fault."""
    real = getattr(owner, name)
    calls = [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(what)
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, flaky)


def test_a_batch_failing_mid_save_leaves_no_reservation(engine, monkeypatch):
    """A codec failure in the third of several batches: the save raises, the batches before it stay
    published (complete and verified), and nothing of the failing batch holds arena bytes or workspace."""
    import orbitkv_fs.manager.save as save_mod

    pages, reg = engine
    _fail_at(monkeypatch, save_mod, "encode_segment", 2 * 2 * L + 3, "injected codec failure")  # 3rd batch
    with Manager(ManagerConfig(pool_size=8 << 20, storage_codec="fp8", batch_segments=2 * L)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(4)
        with pytest.raises(RuntimeError, match="injected"):
            m.save(e.engine_id, chunks)
        assert_reservations_zero(m)
        look = m.lookup(e.engine_id, [c.key for c in chunks], lease=False)
        assert look.count == 2  # the two batches (chunks) before the failure
        monkeypatch.undo()
        assert m.save(e.engine_id, chunks).chunks_saved == 2  # the rest, on a second try
        assert_reservations_zero(m)


def test_a_batch_failing_to_publish_leaves_no_reservation(engine, monkeypatch):
    """The first batch's publish step fails after the next batch was encoded (the pipeline runs ahead):
    the save raises, the batch started ahead is still ended (published), and neither holds arena bytes or
    workspace."""
    from orbitkv_fs.tiers.dram import DramTier

    pages, reg = engine
    _fail_at(monkeypatch, DramTier, "publish_many", 1, "injected publish failure")
    with Manager(ManagerConfig(pool_size=8 << 20, storage_codec="fp8", batch_segments=2 * L)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(4)
        with pytest.raises(RuntimeError, match="injected"):
            m.save(e.engine_id, chunks)
        assert_reservations_zero(m)
        r = m.save(e.engine_id, chunks)  # the rest, on a second try
        assert (r.chunks_present, r.chunks_saved) == (2, 2)  # batch 1 (its segments before the failure) and 2
        assert_reservations_zero(m)


@pytest.mark.parametrize("batch", [1, 3])
def test_an_exact_batch_failing_mid_batch_returns_every_reservation(engine, monkeypatch, batch):
    """Exact segments of host pages are saved a batch at a time (one chunk per batch here): a failure at
    the third segment of a batch (its CRC32C) raises; the batches before it stay published, and the arena's
    used bytes are exactly theirs: every reservation of the failing batch went back."""
    import orbitkv_fs.manager.hostpath as hostpath

    pages, reg = engine
    real = hostpath._crc32c
    calls = [0]

    class FailingCrc:  # fault injection: the CRC32C of one segment raises
        @staticmethod
        def crc32c(data, value=0):
            calls[0] += 1
            if calls[0] == (batch - 1) * 2 * L + 3:
                raise RuntimeError("injected CRC failure")
            return real.crc32c(data, value)

    with Manager(ManagerConfig(pool_size=8 << 20, batch_segments=2 * L)) as m:
        e = m.register_engine(reg)
        start = m.stats().pool_used_bytes
        chunks = chunks_for(4)
        monkeypatch.setattr(hostpath, "_crc32c", FailingCrc)
        with pytest.raises(RuntimeError, match="injected"):
            m.save(e.engine_id, chunks)
        assert_reservations_zero(m)
        st = m.stats()
        assert st.pool_used_bytes - start == sum(st.resident_bytes["dram"].values())
        assert (st.pool_used_bytes == start) == (batch == 1)
        assert m.lookup(e.engine_id, [c.key for c in chunks], lease=False).count == batch - 1
        monkeypatch.undo()
        assert m.save(e.engine_id, chunks).chunks_saved == 4 - (batch - 1)
        assert_reservations_zero(m)


@pytest.mark.parametrize("where", ["publish", "headers", "crc"])
def test_an_exact_batch_failing_returns_every_reservation(engine, monkeypatch, where):
    """The second batch of exact segments fails: to publish, or before (its header writes, or a payload CRC32C
    part way through a group, after its copies). The save raises, the first batch stays published, the arena
    holds exactly its bytes and nothing stays reserved."""
    from orbitkv_fs.manager import hostpath
    from orbitkv_fs.tiers.dram import DramTier

    pages, reg = engine
    if where == "publish":
        _fail_at(monkeypatch, DramTier, "publish_many", 2, "injected publish failure")
    elif where == "headers":
        _fail_at(monkeypatch, hostpath, "_put_headers", 2, "injected header failure")
    else:  # the host path's own CRC32C calls only (the 4th of the second batch's)
        import types

        import crc32c

        monkeypatch.setattr(hostpath, "_crc32c", types.SimpleNamespace(crc32c=crc32c.crc32c))
        _fail_at(monkeypatch, hostpath._crc32c, "crc32c", 2 * L + 4, "injected CRC failure")
    with Manager(ManagerConfig(pool_size=8 << 20, batch_segments=2 * L)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(4)
        with pytest.raises(RuntimeError, match="injected"):
            m.save(e.engine_id, chunks)
        assert_reservations_zero(m)
        st = m.stats()
        assert st.pool_used_bytes == sum(st.resident_bytes["dram"].values()) > 0
        assert m.lookup(e.engine_id, [c.key for c in chunks], lease=False).count == 1


def test_pipelined_starts_the_next_item_before_ending_the_last_and_ends_every_started_one():
    from orbitkv_fs.manager.batching import _pipelined

    log = []

    def start(i):
        if i == 3:
            raise RuntimeError("start 3")
        log.append(f"s{i}")
        return i

    def end(i):
        log.append(f"e{i}")
        return 10 * i

    assert _pipelined([0, 1, 2], start, end) == [0, 10, 20]
    assert log == ["s0", "s1", "e0", "s2", "e1", "e2"]
    log.clear()
    with pytest.raises(RuntimeError, match="start 3"):
        _pipelined([1, 2, 3, 4], start, end)
    assert log == ["s1", "s2", "e1", "e2"]  # the started item 2 is ended, 4 never starts
    log.clear()

    def failing_end(i):
        log.append(f"e{i}")
        if i == 1:
            raise RuntimeError("end 1")
        return i

    with pytest.raises(RuntimeError, match="end 1"):
        _pipelined([0, 1, 2, 4], start, failing_end)
    assert log == ["s0", "s1", "e0", "s2", "e1", "e2"]  # 2 was started when 1 failed: it is ended too


@pytest.mark.parametrize("codec", ["none", "fp8", "turboquant-4", "turboquant-3"])
def test_a_batch_counts_each_segment_at_its_encoded_size(engine, codec):
    """Codec batches are sized by the workspace a segment's encode takes: FP8 half its source, TurboQuant
    its records (2 or 4 bytes of norm or range per vector plus head_dim x bits / 8 of codes), the policy's
    exact layers and every `none` segment their source size."""
    from orbitkv_fs.manager.batching import _coded_bound, _decode_bound
    from orbitkv_fs.segment import Format, SegmentHeader

    pages, reg = engine
    n = 4 * BLOCK_BYTES
    vectors = n // (2 * D)
    with Manager(ManagerConfig(pool_size=16 << 20, storage_codec=codec)) as m:
        e = m.register_engine(reg)
        segs = m._engines[e.engine_id].segs
        for seg in segs:
            if seg.codec is None:
                want = n
            elif codec == "fp8":
                want = n // 2
            else:
                side = 2 if seg.role == Role.KEY else 4
                want = vectors * (side + D * int(codec[-1]) // 8)
            assert _coded_bound(seg, n) == want, (seg.layer, seg.role)
        exact = [seg.layer for seg in segs if seg.codec is None]
        assert exact == ([l for l in range(L) for _ in range(2)] if codec == "none" else
                         [] if codec == "fp8" else [l for l in (0, 1, L - 2, L - 1) for _ in range(2)])
    ans = SegmentHeader(Format.ANS, np.dtype(np.uint16), 4096, 2000, 0)
    fp8 = SegmentHeader(Format.FP8, np.dtype(np.uint16), 4096, 2048, 0)
    assert (_decode_bound(ans), _decode_bound(fp8)) == (4096, 2048)


def test_codec_batches_close_at_the_budget_and_the_source_cap(monkeypatch):
    """``_codec_batches`` closes a batch before its counted bytes would pass the budget, and before its
    logical bytes would pass BATCH_EXPANSION budgets; one item over the budget still makes a batch."""
    import orbitkv_fs.manager.batching as manager

    with Manager(ManagerConfig(pool_size=4 << 20, storage_codec_budget=1 << 20, device="cpu")) as m:
        budget = m._batch_budget()
        items = [(budget // 4, budget) for _ in range(8)]
        sizes = [len(b) for b in m._codec_batches(items, lambda it: it[0])]
        assert sizes == [4, 4]
        sizes = [len(b) for b in m._codec_batches(items, lambda it: it[0], lambda it: it[1])]
        assert sizes == [4, 4]  # 4 budgets of logical bytes fit: the budget in counted bytes closes first
        monkeypatch.setattr(manager, "BATCH_EXPANSION", 2)
        sizes = [len(b) for b in m._codec_batches(items, lambda it: it[0], lambda it: it[1])]
        assert sizes == [2, 2, 2, 2]
        assert [len(b) for b in m._codec_batches([(3 * budget, 0), (1, 0)], lambda it: it[0])] == [1, 1]


def test_gpu_batches_of_raw_and_ans_registrations_hold_two_flights_within_the_same_source_cap(engine):
    """With the GPU engine a codec batch of a registration whose segments take their full size in the workspace
    is BATCH_FLIGHTS flights of half the workspace (the engine cuts it into flights of equal bytes; the
    Manager's per-batch host work is paid once for both): saves of `none` and `ans` registrations, restores of
    `none` ones; other registrations' batches one flight. The source cap stays BATCH_EXPANSION flights; the host
    path keeps one budget."""
    import types

    import orbitkv_fs.manager.batching as manager

    budget = 64 << 20
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=4 << 20, storage_codec_budget=budget, device="cpu")) as m:
        assert m._batch_budget() == m._flight_budget() == budget and m._source_cap() == 4 * budget
        m._gpu_codecs = object()  # the planning arithmetic only: nothing reaches an engine
        try:
            flight = budget // 2 - (1 << 20)
            assert (m._flight_budget(), m._batch_budget(2), m._source_cap()) == (flight, 2 * flight, 4 * flight)
            assert manager.BATCH_FLIGHTS == 2
            for codecs, save, restore in (({"none"}, 2, 2), ({"none", "ans"}, 2, 1), ({"ans"}, 2, 1),
                                          ({"none", "fp8"}, 1, 1), ({"none", "turboquant-4"}, 1, 1)):
                eng = types.SimpleNamespace(codecs=frozenset(codecs))
                assert (m._flights(eng), m._flights(eng, restore=True)) == (save, restore), codecs
            items = [(flight // 4, flight // 4) for _ in range(20)]  # as many coded as source bytes
            assert [len(b) for b in m._codec_batches(items, lambda it: it[0], lambda it: it[1], 2)] == [8, 8, 4]
            assert [len(b) for b in m._codec_batches(items, lambda it: it[0], lambda it: it[1])] == [4] * 5
            items = [(flight // 16, flight // 2) for _ in range(20)]  # compressing: the source cap closes first
            assert [len(b) for b in m._codec_batches(items, lambda it: it[0], lambda it: it[1], 2)] == [8, 8, 4]
        finally:
            m._gpu_codecs = None
    for codec, want in (("none", {"none"}), ("fp8", {"fp8"}), ("turboquant-4", {"none", "turboquant-4"})):
        with Manager(ManagerConfig(pool_size=4 << 20, storage_codec=codec, device="cpu")) as m:
            eng = m._engines[m.register_engine(reg).engine_id]
            assert eng.codecs == want and m._flights(eng) == 1  # no GPU engine: one flight
            m._gpu_codecs = object()
            try:
                assert m._flights(eng) == (2 if codec == "none" else 1)
            finally:
                m._gpu_codecs = None


def test_run_batches_cut_where_the_per_item_rule_does():
    """``_run_batches`` (a save's chunks as runs with cumulative sizes) makes the same batches as
    ``_codec_batches`` over the same items one at a time: random runs of random sizes (zero, over the
    budget, over the logical cap), random budgets and segment caps."""
    import itertools
    import random

    import msgspec

    rnd = random.Random(2)
    with Manager(ManagerConfig(pool_size=4 << 20, device="cpu")) as m:
        for _ in range(300):
            budget = rnd.randrange(1, 5000)
            m._batch_budget = lambda flights=1, budget=budget: budget
            m._config = msgspec.structs.replace(m._config, batch_segments=rnd.randrange(1, 40))
            runs = []
            for r in range(rnd.randrange(0, 12)):
                items = [(r, j, rnd.choice((0, rnd.randrange(budget // 3 + 1), rnd.randrange(2 * budget))),
                          rnd.randrange(3 * budget)) for j in range(rnd.randrange(1, 30))]
                runs.append((items, list(itertools.accumulate((it[2] for it in items), initial=0)),
                             list(itertools.accumulate((it[3] for it in items), initial=0))))
            flat = [it for items, _, _ in runs for it in items]
            want = list(m._codec_batches(flat, lambda it: it[2], lambda it: it[3], run=lambda it: it[0]))
            got = [[it for items, lo, hi in pieces for it in items[lo:hi]] for pieces in m._run_batches(runs)]
            assert got == want


def test_run_batches_take_a_chunk_whole_rather_than_a_sliver_of_it():
    """A batch that would end a quarter or less into a chunk that one batch holds whole ends before it: vLLM's
    72-segment chunks at 512 segments a batch are batches of seven whole chunks (504), not 512 that split
    one; a chunk larger than a batch, or more than a quarter of the batch into one, is cut as before."""
    import itertools

    import msgspec

    def sizes(run_len: int, runs: int, cap: int, budget: int = 1 << 40) -> list[int]:
        m._batch_budget = lambda flights=1: budget
        m._config = msgspec.structs.replace(m._config, batch_segments=cap)
        ones = list(range(run_len + 1))
        return [sum(hi - lo for _, lo, hi in pieces) for pieces in m._run_batches([((r,), ones, ones)
                                                                                   for r in range(runs)])]

    with Manager(ManagerConfig(pool_size=4 << 20, device="cpu")) as m:
        assert sizes(72, 32, 512) == [504, 504, 504, 504, 288]
        assert sizes(72, 32, 512, budget=72 * 7 + 4) == [504, 504, 504, 504, 288]  # the budget's cut too
        assert sizes(600, 2, 512) == [512, 512, 176]  # a chunk no batch holds whole: split
        assert sizes(300, 3, 512) == [512, 388]  # 212 of the second chunk: more than a quarter, split
        assert sizes(300, 3, 400) == [300, 300, 300]  # 100 of 400: a quarter, whole to the next batch
        flat = [[(r, j) for j in range(72)] for r in range(32)]
        m._config = msgspec.structs.replace(m._config, batch_segments=512)
        assert [len(b) for b in m._codec_batches(itertools.chain(*flat), lambda it: 1, run=lambda it: it[0])] == [
            504, 504, 504, 504, 288]


@pytest.mark.parametrize("codec", ["turboquant-4", "fp8"])
def test_save_batches_are_the_per_segment_rule_over_the_missing_segments(engine, codec):
    """The batches a save hands to the codecs are ``_codec_batches`` over the segments it lacks, one at a
    time in chunk and segment order (each segment's coded bound, its source bytes): chunks of random block
    counts, some present in part (invalidated segments), some in full; TurboQuant's exact layers take the
    host path and are in no codec batch. Every segment ends cached."""
    import random

    pages, reg = engine
    rnd = random.Random(4)
    with Manager(ManagerConfig(pool_size=32 << 20, storage_codec=codec, storage_codec_budget=9 * BLOCK_BYTES,
                               batch_segments=7)) as m:
        e = m.register_engine(reg)
        eng = m._engines[e.engine_id]
        seen: list[list] = []
        submit = m._save_submit
        m._save_submit = lambda en, rows: seen.append(rows.items(en.segs)) or submit(en, rows)
        for round_ in range(3):
            chunks, b = [], 0
            for i in range(12):
                n = rnd.randrange(1, 5)
                chunks.append(ChunkBlocks(chunk_key(f"r{i}"), list(range(b, b + n))))
                b += n
            keys = {ch.key: [ObjectKey(eng.ns[:16], ch.key, s.layer, s.role).pack() for s in eng.segs]
                    for ch in chunks}
            gone = {k for ks in keys.values() for k in ks if rnd.random() < 0.3}
            m.dram.invalidate_keys(gone)
            want = [(ch, seg, kb) for ch in chunks for seg, kb in zip(eng.segs, keys[ch.key])
                    if not m.dram.contains(kb) and seg.codec is not None]
            seen.clear()
            m.save(e.engine_id, chunks)
            assert seen == list(m._codec_batches(want, lambda it: it[1].coded_bound(len(it[0].blocks)),
                                                 lambda it: len(it[0].blocks) * it[1].block_bytes,
                                                 run=lambda it: id(it[0])))
            assert len(seen) >= 2 and all(m.dram.contains(k) for ks in keys.values() for k in ks)
        assert_reservations_zero(m)


@pytest.mark.parametrize("codec, expansion, per_batch", [("fp8", 4, 15), ("fp8", 1, 7)])
def test_a_codec_batch_never_passes_the_budget(engine, monkeypatch, codec, expansion, per_batch):
    """Save batches close before the next segment's encoded bytes would pass the codec budget (on a GPU two
    batches must fit side by side in the engine's workspace): 128 KiB segments (64 KiB in FP8) under a budget
    one byte short of eight of them make batches of fifteen, or of seven when the source cap
    (BATCH_EXPANSION budgets of source bytes) is one budget."""
    import orbitkv_fs.manager.batching as manager

    monkeypatch.setattr(manager, "BATCH_EXPANSION", expansion)
    pages, reg = engine
    per = 32  # blocks per chunk: 128 KiB per (layer, role) segment
    seg = per * BLOCK_BYTES
    with Manager(ManagerConfig(pool_size=16 << 20, storage_codec=codec, storage_codec_budget=8 * seg - 1)) as m:
        e = m.register_engine(reg)
        r = m.save(e.engine_id, chunks_for(2, per=per))
        assert r.segments == 2 * 2 * L
        assert m.stats().codec_batches == -(-2 * 2 * L // per_batch)
        assert_reservations_zero(m)


def test_host_batch_publishes_chunk_major_in_request_order(engine):
    """Exact host segments are copied segment-major but published chunk by chunk, in the request's order: the
    index takes a chunk's new segments in one step, and the eviction policy ages chunks as the engine sent
    them (a key-ordered publication aged them by hash)."""
    from orbitkv_fs.keys import pack_key

    pages, reg = engine
    with Manager(ManagerConfig(pool_size=64 << 20)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(6, salt="order")
        m.save(e.engine_id, chunks)
        ns = bytes.fromhex(e.namespace)
        ix = m.dram.index
        gens = [[ix.generation[ix.get(pack_key(ns, ch.key, layer, role))] for layer in range(L)
                 for role in (Role.KEY, Role.VALUE)] for ch in chunks]
        for earlier, later in zip(gens, gens[1:]):
            assert max(earlier) < min(later)


def test_an_exact_segment_over_the_bound_is_refused_before_any_reservation():
    """A chunk whose exact segment would pass the segment format's 32 MiB bound is a RequestError naming it;
    the batch it came in reserves and publishes nothing (its other chunks included)."""
    pages, reg = make_engine(num_layers=1, num_blocks=8300)
    try:
        with Manager(ManagerConfig(pool_size=64 << 20)) as m:
            e = m.register_engine(reg)
            big = ChunkBlocks(chunk_key("big"), list(range(8, 8208)))  # 8200 blocks of 4 KiB: 32.03 MiB
            with pytest.raises(RequestError, match="8200 blocks makes a 33587200-byte segment"):
                m.save(e.engine_id, chunks_for(2) + [big])
            assert_reservations_zero(m)
            assert not m.dram.index.chunks
            assert m.save(e.engine_id, chunks_for(2)).chunks_saved == 2  # the same chunks without it: saved
    finally:
        pages.close()


def _save_patched(monkeypatch, m: Manager, engine_id: str, chunks, owner, name: str, wrap):
    """``m.save(engine_id, chunks)`` with ``owner.name`` replaced by ``wrap(the real one)`` for that save only."""
    monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))
    try:
        return m.save(engine_id, chunks)
    finally:
        monkeypatch.undo()


def _assert_exact_bytes(r, segments: int) -> None:
    """A save result's byte counts for ``segments`` exact segments of this module's 2-block chunks."""
    assert r.logical_bytes == segments * 2 * BLOCK_BYTES
    assert r.stored_bytes == r.logical_bytes + segments * HEADER_SIZE


def _first_key_present(real):
    """An ``ObjectIndex.add_many`` that answers a batch's first key present (another save published it between
    this batch's reservation and its publish) and adds the others (their scan left to the index: ``runs`` is
    the whole batch's)."""
    def add_many(self, keys, *columns, runs=None):
        return np.concatenate(([-1], real(self, keys[1:], *(c[1:] for c in columns))))
    return add_many


def test_an_exact_batch_with_some_segments_placed_publishes_those(engine, monkeypatch):
    """A host batch where DRAM found room for only some segments: those are published (their bytes
    restorable, the others dropped with no lower tier), the counts add up, nothing stays reserved."""
    from orbitkv_fs.tiers.dram import DramTier

    pages, reg = engine

    def every_other(real):
        def reserve_many(self, sizes):
            offs = real(self, sizes)
            for i in range(1, len(offs), 2):  # no room for these: given back, answered None
                self.cancel(offs[i], sizes[i])
                offs[i] = None
            return offs
        return reserve_many

    with Manager(ManagerConfig(pool_size=64 << 20)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(3, salt="half")
        r = _save_patched(monkeypatch, m, e.engine_id, chunks, DramTier, "reserve_many", every_other)
        total = 3 * 2 * L
        assert r.dropped_segments == total // 2 and r.segments == total - total // 2
        _assert_exact_bytes(r, r.segments)
        assert m.lookup(e.engine_id, [c.key for c in chunks], lease=False).count == 0  # no chunk whole
        assert_reservations_zero(m)
        r2 = m.save(e.engine_id, chunks)  # the dropped half now: every chunk whole, its bytes the engine's
        assert r2.segments == total // 2 and r2.chunks_saved == 3
        want = snapshot(pages)
        zero(pages)
        assert all(m.restore(e.engine_id, chunks).restored)
        blocks = [b for c in chunks for b in c.blocks]
        assert all(np.array_equal(pages.array(n)[blocks].view(np.uint16), want[n][blocks].view(np.uint16))
                   for n in pages.tensors)
        assert_reservations_zero(m)


def test_an_exact_batch_whose_key_turns_out_present_counts_only_what_it_published(engine, monkeypatch):
    """A host batch where the index answers one key present at publish time (another save published it
    between this batch's reservation and its publish): that extent goes back, the key is not counted as this
    save's, the rest are published and counted, nothing stays reserved."""
    from orbitkv_fs.index import ObjectIndex

    pages, reg = engine

    with Manager(ManagerConfig(pool_size=64 << 20)) as m:
        e = m.register_engine(reg)
        chunks = chunks_for(2, salt="present")
        r = _save_patched(monkeypatch, m, e.engine_id, chunks, ObjectIndex, "add_many", _first_key_present)
        total = 2 * 2 * L
        assert r.segments == total - 1 and r.dropped_segments == 0
        _assert_exact_bytes(r, total - 1)
        assert r.chunks_saved == 2  # each chunk had segments admitted by this save
        assert m.lookup(e.engine_id, [c.key for c in chunks], lease=False).count == 0  # the first one lacks a key
        assert_reservations_zero(m)
        assert m.stats().pool_used_bytes == (total - 1) * ((HEADER_SIZE + 2 * BLOCK_BYTES + 511) // 512 * 512)


def test_a_refused_exact_key_is_not_counted_in_the_raw_reasons(engine, monkeypatch):
    """The same refusal with TurboQuant, whose policy-exact layers take the host path with reason ``policy``:
    the refused segment is in neither the saved segments nor the raw reasons."""
    from orbitkv_fs.index import ObjectIndex

    pages, reg = engine

    with Manager(ManagerConfig(pool_size=64 << 20, storage_codec="turboquant-4")) as m:
        e = m.register_engine(reg)
        r = _save_patched(monkeypatch, m, e.engine_id, chunks_for(2, salt="policy"), ObjectIndex, "add_many",
                          _first_key_present)
        exact = 2 * 2 * 4  # two chunks, K and V of the first and last two of the L layers
        assert r.segments == 2 * 2 * L - 1 and r.raw_segments == {"policy": exact - 1}
        assert m.stats().raw_segments == {"policy": exact - 1}
        assert_reservations_zero(m)


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_restore_naming_a_chunk_twice_and_a_missing_one(engine, codec):
    """A restore whose request names one chunk twice (into two block sets) around a chunk never saved: the
    leased extents are found per key in request order (duplicates leased twice, dropped twice), both copies
    are written as saved, the absent chunk is a miss counted once per segment, and every lease goes back."""
    pages, reg = engine
    orig = snapshot(pages)
    with Manager(ManagerConfig(pool_size=8 << 20, storage_codec=codec)) as m:
        e = m.register_engine(reg)
        saved = ChunkBlocks(chunk_key("twice"), [0, 1])
        m.save(e.engine_id, [saved])
        zero(pages)
        again = ChunkBlocks(saved.key, [4, 5])
        absent = ChunkBlocks(chunk_key("never"), [2, 3])
        misses0 = m.stats().misses
        r = m.restore(e.engine_id, [saved, absent, again])
        assert r.restored == [True, False, True] and [x.key for x in r.misses] == [absent.key]
        assert m.stats().misses - misses0 == 2 * L  # every segment of the absent chunk, once
        for name in pages.tensors:
            a = pages.array(name)
            if codec == "none":
                assert np.array_equal(a[[0, 1]].view(np.uint16), orig[name][[0, 1]].view(np.uint16))
            assert np.array_equal(a[[4, 5]].view(np.uint16), a[[0, 1]].view(np.uint16))  # the same segment twice
            assert not a[[2, 3]].view(np.uint16).any()
        assert_reservations_zero(m)


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_a_save_naming_a_chunk_twice_stores_it_once(engine, codec):
    """A save whose request names one chunk twice (from two block sets), around another chunk, with batches
    small enough that the two copies land in different batches and large enough for one: each segment is
    published once (the second copy's extents go back), the result counts it once, a restore gives what the
    first copy alone restores, and nothing stays reserved."""
    pages, reg = engine
    orig = snapshot(pages)
    first, other = ChunkBlocks(chunk_key("dup"), [0, 1]), ChunkBlocks(chunk_key("other"), [2, 3])
    second = ChunkBlocks(first.key, [4, 5])  # the same key from other blocks: a request naming the chunk twice
    into = [ChunkBlocks(first.key, [6, 7])]

    def restored(m: Manager, engine_id: str) -> dict:
        for n in pages.tensors:
            pages.array(n)[6:8] = 0
        assert m.restore(engine_id, into).restored == [True]
        got = {n: pages.array(n)[6:8].copy() for n in pages.tensors}
        for n in pages.tensors:
            pages.array(n)[...] = orig[n]
        return got

    with Manager(ManagerConfig(pool_size=8 << 20, storage_codec=codec)) as ref:
        e = ref.register_engine(reg)
        ref.save(e.engine_id, [first])
        want = restored(ref, e.engine_id)
    assert any(not np.array_equal(orig[n][[0, 1]], orig[n][[4, 5]]) for n in pages.tensors)  # the copies differ
    for per_batch in (3, 64):
        with Manager(ManagerConfig(pool_size=8 << 20, storage_codec=codec, batch_segments=per_batch)) as m:
            e = m.register_engine(reg)
            eng = m._engines[e.engine_id]
            r = m.save(e.engine_id, [first, other, second])
            nseg = len(eng.segs)
            assert r.segments == 2 * nseg and m.dram.chunk_count(eng.ns + first.key) == nseg
            # chunks saved count distinct keys; the second copy is present when the first was published before
            assert r.chunks_saved == 2 and r.chunks_present in (0, 1)
            assert_reservations_zero(m)
            assert m.dram.used_bytes == sum(m.dram.resident_bytes.values())  # the second copy's extents freed
            got = restored(m, e.engine_id)
            assert all(np.array_equal(got[n].view(np.uint8), want[n].view(np.uint8)) for n in pages.tensors)
            assert_reservations_zero(m)


def test_a_save_of_more_block_ids_than_the_engine_has_is_refused_before_they_are_checked(engine, monkeypatch):
    """Each block of a save comes at most once, so a save naming more ids than the engine has blocks is
    refused from the chunks' lengths alone (an engine's 18 million ids took the array check 2.8 s and 740 MB
    before it found the first repeat: docs/results/2026-12-05-dataplane-bulk); nothing is saved."""
    from orbitkv_fs.manager import registry

    pages, reg = engine
    with Manager(ManagerConfig(pool_size=8 << 20)) as m:
        e = m.register_engine(reg)
        checked = []
        monkeypatch.setattr(registry, "_chunks_ok", lambda *a: checked.append(a) or True)
        over = [ChunkBlocks(chunk_key(f"o{i}"), list(range(B))) for i in range(2)]  # 2B ids, B blocks
        with pytest.raises(RequestError, match=f"{2 * B} block ids in one request, the engine has {B} blocks"):
            m.save(e.engine_id, over)
        assert not checked and m.stats().resident_objects["dram"] == 0
        assert m.save(e.engine_id, over[:1]).chunks_saved == 1  # B ids: the array check, then saved
        assert len(checked) == 1


@pytest.mark.parametrize("seed", range(8))
def test_request_blocks_checked_as_an_array_agree_with_the_walk(seed):
    """A request's keys and blocks, checked in one numpy pass, pass exactly when the block-by-block walk does
    (which names the first fault; it alone decides where a block id is not an int): valid requests, with skips,
    and each kind of fault (an unknown or negative block, one past 64 bits either way, one twice, a chunk of
    skips only, a skip where none is allowed, a short key, no blocks, a block id that is not an int)."""
    import random
    import types

    from orbitkv_fs.manager.registry import Registry, _chunks_ok

    rng = random.Random(seed)
    eng = types.SimpleNamespace(num_blocks=64)
    walk = Registry._check_chunks_walk
    faults = [lambda b: b.__setitem__(0, 64), lambda b: b.__setitem__(0, -2), lambda b: b.append(b[0]),
              lambda b: b.__setitem__(slice(None), [SKIP_BLOCK] * len(b)), lambda b: b.__setitem__(0, "3"),
              lambda b: b.__setitem__(0, 3.0), lambda b: b.__setitem__(0, True), lambda b: b.clear(),
              lambda b: b.__setitem__(0, 1 << 70), lambda b: b.__setitem__(0, -(1 << 70)), None, None]
    for _ in range(60):
        ids = rng.sample(range(64), 24)
        chunks = [ids[i:i + 4] for i in range(0, 24, 4)]
        skips = rng.random() < 0.5
        if rng.random() < 0.5:
            chunks[rng.randrange(6)][rng.randrange(4)] = SKIP_BLOCK
        fault = rng.choice(faults)
        if fault is not None:
            fault(chunks[rng.randrange(6)])
        keys = [chunk_key(f"c{i}") for i in range(6)]
        if rng.random() < 0.1:
            keys[rng.randrange(6)] = b"short"
        req = [ChunkBlocks(k, b) for k, b in zip(keys, chunks)]
        try:
            walk(None, eng, req, skips=skips)
            walked = True
        except (RequestError, TypeError):
            walked = False
        ok = _chunks_ok(req, eng.num_blocks, skips)
        assert walked or not ok, (req, skips)  # what the walk refuses never passes the array check
        if all(type(b) is int for c in chunks for b in c):  # ints only: the array check decides alone
            assert ok == walked, (req, skips)


@pytest.mark.parametrize("codec", ["none", "turboquant-4"])
@pytest.mark.parametrize("batch_segments", [5, 2 * L, 512])
def test_exact_batches_store_what_the_per_segment_path_stores(codec, batch_segments):
    """Exact segments of host pages saved in batches of every shape: chunks of consecutive blocks (a group's
    pieces move with one copy), of shuffled blocks, of other block counts in the same batch (templates per
    size), partly cached chunks (some of their segments only) and chunks that batches split. Every key holds
    byte for byte the segment the per-segment path makes of its blocks (:func:`raw_segment`, the policy's
    reason where TurboQuant keeps a layer exact), and the batches keep within their caps."""
    from orbitkv_fs.manager.hostpath import HostPath

    pages, reg = make_engine(num_blocks=96)
    rng = np.random.default_rng(3)
    shuffled = rng.permutation(np.arange(40, 96)).tolist()
    chunks = (chunks_for(4, salt="run")  # blocks 0..7, consecutive across chunks
              + [ChunkBlocks(chunk_key("three"), [8, 9, 10]), ChunkBlocks(chunk_key("one"), [11])]
              + chunks_for(3, per=3, base=12, salt="run3")  # 12..20
              + [ChunkBlocks(chunk_key(f"shuf{i}"), shuffled[4 * i:4 * i + 4]) for i in range(5)]
              + [ChunkBlocks(chunk_key("gap"), [30, 32]), ChunkBlocks(chunk_key("back"), [35, 34])]
              # each of consecutive blocks, but not after the chunk before it
              + [ChunkBlocks(chunk_key("hop0"), [24, 25]), ChunkBlocks(chunk_key("hop1"), [28, 29]),
                 ChunkBlocks(chunk_key("hop2"), [26, 27])])
    batches = []
    real = HostPath._save_raw_batch

    def record(self, eng, rows, acc):
        batches.append((len(rows), int((np.fromiter(map(len, (c.blocks for c in rows.chunks)), np.int64)[rows.ci]
                                        * eng.block_bytes[rows.si]).sum())))
        return real(self, eng, rows, acc)

    try:
        with Manager(ManagerConfig(pool_size=16 << 20, storage_codec=codec, batch_segments=batch_segments,
                                   device="cpu")) as m, pytest.MonkeyPatch.context() as mp:
            mp.setattr(HostPath, "_save_raw_batch", record)
            e = m.register_engine(reg)
            eng = m._engines[e.engine_id]
            # chunk "three" partly cached: saved alone, then all but its first layer's segments invalidated
            m.save(e.engine_id, chunks[4:5])
            assert m.dram.invalidate_keys([k for k, _ in m.dram.index.items() if k[32:34] != b"\0\0"])[0] == 2 * (L - 1)
            batches.clear()
            r = m.save(e.engine_id, chunks)
            assert r.segments == 2 * L * len(chunks) - 2 and r.dropped_segments == 0
            exact = [s for s in eng.segs if s.codec is None]
            assert len(exact) == (2 * L if codec == "none" else 8)
            assert sum(n for n, _ in batches) == len(exact) * len(chunks) - 2
            cap_segments, cap_bytes = m._raw_batch_cap()
            assert batches and all(n <= cap_segments and (b <= cap_bytes or n == 1) for n, b in batches)
            _assert_stored_as_per_segment(m, e, chunks)
            assert_reservations_zero(m)
    finally:
        pages.close()


def _assert_stored_as_per_segment(m: Manager, e, chunks) -> None:
    """Every exact segment of ``chunks`` in DRAM holds what the per-segment path makes of its blocks."""
    from orbitkv_fs.codecs import raw_segment
    from orbitkv_fs.keys import pack_key
    from orbitkv_fs.manager.device import _gather_host

    ns = bytes.fromhex(e.namespace)
    for ch in chunks:
        for seg in m._engines[e.engine_id].segs:
            if seg.codec is None:
                got = m.dram.read(pack_key(ns, ch.key, seg.layer, seg.role))
                want = raw_segment(_gather_host(seg, ch.blocks), role=seg.role, layer=seg.layer, reason=seg.raw_reason)
                assert got == want, (ch.key, seg.layer, seg.role)


def test_exact_batches_carved_from_a_fragmented_pool_store_what_the_per_segment_path_stores(engine):
    """A pool whose free room lies in holes (every other chunk saved before invalidated): a batch's pieces
    are carved from several free extents, so a (layer, role)'s pieces do not lie evenly spaced across a hole's
    edge, and those move a piece at a time. Every segment still holds the per-segment path's bytes, and so do
    the objects around the holes."""
    pages, reg = engine
    with Manager(ManagerConfig(pool_size=4 << 20, device="cpu")) as m:
        e = m.register_engine(reg)
        fill = [ChunkBlocks(chunk_key(f"fill{i}"), [40 + i % 2 * 2, 41 + i % 2 * 2]) for i in range(40)]
        for ch in fill:  # one request each: the fillers share blocks
            m.save(e.engine_id, [ch])
        holes = {bytes.fromhex(e.namespace) + ch.key for ch in fill[::2]}
        assert m.dram.invalidate_chunks(holes)[0] == 20 * 2 * L
        offs = []
        real = m.dram.reserve_many

        def reserve_many(sizes):
            offs.append(real(sizes))
            return offs[-1]

        m.dram.reserve_many = reserve_many
        chunks = chunks_for(12, salt="frag")
        r = m.save(e.engine_id, chunks)
        assert r.segments == 12 * 2 * L and r.dropped_segments == 0
        piece = (HEADER_SIZE + 2 * BLOCK_BYTES + 511) // 512 * 512
        assert any(b - a != piece for o in offs for a, b in zip(o, o[1:]))  # carved: pieces not end to end
        _assert_stored_as_per_segment(m, e, chunks)
        _assert_stored_as_per_segment(m, e, [ch for ch in fill[1::2] if m.dram.contains(
            bytes.fromhex(e.namespace) + ch.key + bytes(4))])
        assert_reservations_zero(m)


def test_group_runs_find_the_groups_that_move_with_one_copy():
    """``_group_runs`` over a segment-major batch: a group is one slice of blocks exactly when it has two pieces
    or more, all placed, of one size, laid end to end, and its chunks in order hold consecutive blocks; a
    group's first piece is not held to the group before it."""
    from orbitkv_fs.manager.hostpath import _group_runs

    P = (HEADER_SIZE + 2 * BLOCK_BYTES + 511) // 512 * 512  # a 2-block piece
    Q = (HEADER_SIZE + 3 * BLOCK_BYTES + 511) // 512 * 512
    chunks = [ChunkBlocks(chunk_key(f"g{i}"), b) for i, b in enumerate([[0, 1], [2, 3], [4, 5], [9, 8], [6, 7, 8]])]
    two, three = 2 * BLOCK_BYTES, 3 * BLOCK_BYTES
    groups = [  # (chunks, payload bytes, offsets) per group, and the answer
        ([0, 1, 2], [two] * 3, [0, P, 2 * P], slice(0, 6)),
        ([0, 1, 2], [two] * 3, [3 * P, 4 * P, 5 * P], slice(0, 6)),  # after a group that ended at block 6
        ([0, 3], [two] * 2, [6 * P, 7 * P], None),  # chunk 3's blocks run backwards
        ([1], [two], [8 * P], None),  # one piece
        ([1, 2], [two] * 2, [9 * P, 11 * P], None),  # a gap between the pieces
        ([2, 4], [two, three], [12 * P, 13 * P], None),  # consecutive blocks, pieces of two sizes
        ([0, 1], [two] * 2, [-1, 14 * P], None),  # a piece not placed
        ([1, 2], [two] * 2, [15 * P, 16 * P], slice(2, 6)),
        ([4, 3], [three, two], [17 * P, 17 * P + Q], None),
    ]
    sci = np.array([c for g in groups for c in g[0]], dtype=np.int64)
    ssz = np.array([n for g in groups for n in g[1]], dtype=np.int64)
    off = np.array([o for g in groups for o in g[2]], dtype=np.int64)
    starts = np.cumsum([0] + [len(g[0]) for g in groups[:-1]])
    assert _group_runs(chunks, sci, ssz, off, starts) == [g[3] for g in groups]
