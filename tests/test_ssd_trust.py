"""Trust boundaries of the SSD log (issue 23): KV content never becomes a record, records are bound to
their key, generation, place and payload, an invalidation is durable when it answers, generations never
wrap. Where the attack uses real processes, so does the test: a forged record saved from an engine's
pages through a real Manager (codec ``none``) in a child process and a real restart with recovery; a real
SIGKILL right after an invalidation answered."""

from __future__ import annotations

import os
import signal
import struct
import time

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration, Manager, ManagerConfig
from orbitkv_fs.pages import host_engine_pages
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment, crc32c
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from ssd_manager_child import SsdManager
from test_ssd_common import direct_io_dir, key, segment

VICTIM_BLOCKS = 4  # an mla block is 16 x 64 bf16 = 2 KiB: an 8 KiB payload, a 3-block record
ATTACKER_BLOCKS = 10  # a 20 KiB payload, a 6-block record
#: The attacker places its image where its own record's fourth 4 KiB block starts (record header 128 bytes
#: and segment header 64 bytes come before the payload).
FORGED_AT = 3 * 4096 - 192
HUGE_GENERATION = (1 << 64) - 2


def _forged_segment() -> bytes:
    h = SegmentHeader(Format.RAW, np.dtype(ml_dtypes.bfloat16), 8192, 8192, 0, role=Role.OPAQUE, layer=0)
    return build_segment(h, b"\x41" * 8192)


def _v1_image(packed_key: bytes, generation: int, seg: bytes) -> bytes:
    """A complete record of the format before version 2 (every CRC valid): what the scan of that format
    took for a record wherever it found one on a 4 KiB boundary."""
    rec_len = -(-(128 + len(seg)) // 4096) * 4096
    head = struct.pack("<4sHH36sQII64x", b"OKVR", 1, 128, packed_key, generation, len(seg), rec_len)
    return head + struct.pack("<I", crc32c(head)) + seg


def _victim(directory: str, blocks: int = 400):
    """The victim engine's pages (the seed the child fills them from) and registration."""
    pages, descs = host_engine_pages(num_layers=1, num_blocks=blocks, block_size=16, num_heads=2, head_dim=64,
                                     layout="mla", directory=directory)
    rng = np.random.default_rng(1)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = (rng.standard_normal(a.shape) * 2).astype(ml_dtypes.bfloat16)
    reg = EngineRegistration(model="victim", num_layers=1, layer_start=0, layer_end=1, block_size=16, num_heads=2,
                             head_dim=64, dtype="bfloat16", tensors=descs, attention="mla")
    return pages, reg


def _chunk_blocks(i: int) -> list[int]:
    return list(range(VICTIM_BLOCKS * i, VICTIM_BLOCKS * (i + 1)))


@pytest.mark.parametrize("exposure", ["invalidated", "ring-overwrite"])
def test_forged_record_in_kv_pages_is_never_adopted(tmp_path, exposure):
    """An engine writes into its own pages the byte image of a complete record for another namespace's key
    with a huge generation, on a 4 KiB boundary of its own record, and saves it (codec none). Its own
    record head then goes (it invalidates itself, or the ring overwrites it); after a restart with
    recovery the victim's restore returns the victim's bytes, never the attacker's, and the Manager goes
    on writing (a planted generation near 2^64 stopped every SSD write). The image is of the record format
    the scan used to trust; an image of the current format, whose tag the attacker cannot compute, is
    ``test_ssd_recovery_scan.py``'s forged candidates."""
    ssd = direct_io_dir(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    paths = (str(ssd / "s0.okv"),)
    cap = 1 << 20
    target = 40 if exposure == "ring-overwrite" else 5
    child = SsdManager(dir=str(shm), paths=list(paths), capacity=cap)
    try:
        vns = child("engine", name="victim", blocks=400, seed=1)["namespace"]
        child("engine", name="attacker", blocks=ATTACKER_BLOCKS, seed=2)
        packed = ObjectKey(bytes.fromhex(vns), chunk_key(f"v{target}"), 0, Role.OPAQUE).pack()
        image = _v1_image(packed, HUGE_GENERATION, _forged_segment())
        child("forge", name="attacker", blocks=list(range(ATTACKER_BLOCKS)), at=FORGED_AT, image=image.hex())
        assert child("save", name="attacker", chunks=[["evil", list(range(ATTACKER_BLOCKS))]], flush=True)["flushed"] == 1
        stored = bytes.fromhex(child("segment", name="attacker", chunk="evil")["segment"])
        assert stored[64 + FORGED_AT:64 + FORGED_AT + len(image)] == image  # the image is in its payload
        (attacker,) = [r for r in child("records")["records"] if r[0] != vns]
        if exposure == "invalidated":
            for i in range(10):
                child("save", name="victim", chunks=[[f"v{i}", _chunk_blocks(i)]], flush=True)
            child("invalidate", engine="attacker")
        else:
            i = 0
            while any(r[0] != vns for r in child("records")["records"]):
                child("save", name="victim", chunks=[[f"v{i}", _chunk_blocks(i)]], flush=True)
                i += 1
            assert target < i < 100
            with open(paths[0], "rb") as f:  # the ring took the record's head, the image is still there
                f.seek(attacker[5] + FORGED_AT + 192)
                assert f.read(4) == b"OKVR"
        child("close")
    finally:
        child.close()

    pages, reg = _victim(str(shm))
    name = next(iter(pages.tensors))
    try:
        tier = SsdTier(SsdConfig(paths=paths, capacity=cap, recover=True))
        with Manager(ManagerConfig(pool_size=4 << 20, storage_codec="none", shm_dir=str(shm), ssd_prefetch_chunks=0),
                     lower_tier=tier) as m:
            e = m.register_engine(reg)
            assert e.namespace == vns
            blocks = _chunk_blocks(target)
            want = pages.array(name)[blocks].copy()
            pages.array(name)[blocks] = 0
            lk = m.lookup(e.engine_id, [chunk_key(f"v{target}")])
            res = m.restore(e.engine_id, [ChunkBlocks(chunk_key(f"v{target}"), blocks)], lease_id=lk.lease_id)
            got = pages.array(name)[blocks]
            assert got.view(np.uint8).tobytes() != b"\x41" * (len(blocks) * 2048), "the attacker's bytes were served"
            assert (lk.count, res.restored) == (1, [True])
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
            # The tier keeps writing (with the forged generation adopted, every submit raised struct.error).
            m.save(e.engine_id, [ChunkBlocks(chunk_key("after"), _chunk_blocks(99))])
            f = m.flush_dram()
            assert f.dropped.objects == 0 and f.submitted.objects >= 1
            assert tier.snapshot().write_errors_total == 0
            assert m.lookup(e.engine_id, [chunk_key("after")], lease=False).count == 1
    finally:
        pages.close()


@pytest.mark.parametrize("scope,delay", [("chunks", 0.0), ("namespace", 0.0025), ("keys", 0.005)])
def test_invalidation_is_durable_when_it_answers(tmp_path, scope, delay):
    """A SIGKILL 0-5 ms after an invalidation answered: after a restart with recovery none of the
    invalidated chunks comes back (the header wipes used to be queued after the answer: 274 of 720 came
    back), and everything else does."""
    ssd = direct_io_dir(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    paths = (str(ssd / "k0.okv"), str(ssd / "k1.okv"))
    cap = 64 << 20
    names = [f"c{i}" for i in range(720)]
    victims = names if scope == "namespace" else names[:360]
    child = SsdManager(dir=str(shm), paths=list(paths), capacity=cap)
    try:
        ns = child("engine", name="e", layout="separate", layers=2, blocks=60, seed=3)["namespace"]
        for j in range(0, len(names), 60):
            r = child("save", name="e", chunks=[[n, [i]] for i, n in enumerate(names[j:j + 60])], flush=True)
            assert r["dropped"] == 0
        if scope == "chunks":
            r = child("invalidate", engine="e", chunks=victims)
        elif scope == "namespace":
            r = child("invalidate", engine="e")
        else:
            r = child("invalidate", keys={"engine": "e", "list": [[n, layer, role] for n in victims
                                                                 for layer in (0, 1) for role in (1, 2)]})
        time.sleep(delay)
        os.kill(child.proc.pid, signal.SIGKILL)
        assert r["lower"] == 4 * len(victims)
    finally:
        child.proc.kill()
        child.proc.wait()
        child.proc.stdin.close()
        child.proc.stdout.close()
    with SsdTier(SsdConfig(paths=paths, capacity=cap, recover=True)) as t:
        back = {k.chunk for k, _ in t.iter_objects(bytes.fromhex(ns))}
        assert not back & {chunk_key(n) for n in victims}, "invalidated chunks came back"
        assert back == {chunk_key(n) for n in names[len(victims):]}


def _swap(path: str, a: int, b: int, start: int, length: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        x, y = os.pread(fd, length, a + start), os.pread(fd, length, b + start)
        os.pwrite(fd, y, a + start)
        os.pwrite(fd, x, b + start)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("recover", [False, True])
def test_swapped_segments_between_records_serve_no_key_the_other_s_bytes(tmp_path, recover):
    """Swapping the bytes after the record header (segment header and payload) between records of the same
    length, layer and role: neither the running tier nor a recovered one serves a key the other's bytes
    (all 24 keys of 12 pairs were served each other's bytes when the record header did not bind its
    segment)."""
    path = str(direct_io_dir(tmp_path) / "p.okv")
    t = SsdTier(SsdConfig(paths=(path,), capacity=8 << 20))
    try:
        for i in range(24):
            assert t.submit(key(i), segment(i))
        t.flush()
        recs = {o.key: o for o in t.iter_records()}
        if recover:
            t.close()
        for i in range(0, 24, 2):
            _swap(path, recs[key(i)].offset, recs[key(i + 1)].offset, 128, len(segment(0)))
        if recover:
            t = SsdTier(SsdConfig(paths=(path,), capacity=8 << 20, recover=True))
        got = t.read_many([key(i) for i in range(24)])
    finally:
        t.close()
    assert sum(g is not None and g != segment(i) for i, g in enumerate(got)) == 0


@pytest.mark.parametrize("damage", ["payload", "header", "replayed over it"])
def test_an_older_record_is_not_served_when_the_newer_one_is_damaged(tmp_path, damage):
    """Rollback: a key written twice; the newer record is damaged (a payload byte, a header byte) or the
    older record's bytes are replayed over it. A recovered tier does not serve the older bytes."""
    path = str(direct_io_dir(tmp_path) / "r.okv")
    with SsdTier(SsdConfig(paths=(path,), capacity=8 << 20)) as t:
        for i in range(6):
            t.submit(key(i), segment(i))
        t.flush()
        old = next(o for o in t.iter_records() if o.key == key(2))
        t.submit(key(2), segment(2, version=1))
        for i in range(6, 9):
            t.submit(key(i), segment(i))
        t.flush()
        new = next(o for o in t.iter_records() if o.key == key(2))
    length = 128 + len(segment(2))
    fd = os.open(path, os.O_RDWR)
    try:
        if damage == "replayed over it":
            os.pwrite(fd, os.pread(fd, length, old.offset), new.offset)
        else:
            pos = new.offset + (128 + 64 + 100 if damage == "payload" else 50)
            os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x5A]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)
    with SsdTier(SsdConfig(paths=(path,), capacity=8 << 20, recover=True)) as t:
        assert t.read(key(2)) != segment(2), "the older version of the key was served"
        assert t.read(key(2)) is None
        # Records newer than the damage are served; after damage to a header (or a replay, which fails
        # its offset) nothing older than it is.
        assert [t.read(key(i)) for i in range(6, 9)] == [segment(i) for i in range(6, 9)]


def test_a_generation_near_2_64_refuses_writes_with_a_counter_never_an_error(tmp_path):
    """A tier whose generation counter stands near 2^64 (what a planted record used to cause) refuses
    writes, counted; nothing raises (every submit raised struct.error, flush-dram answered HTTP 500)."""
    path = str(direct_io_dir(tmp_path) / "g.okv")
    tier = SsdTier(SsdConfig(paths=(path,), capacity=8 << 20))
    pages, reg = _victim(str(tmp_path), blocks=8)
    try:
        with Manager(ManagerConfig(pool_size=1 << 20, storage_codec="none", shm_dir=str(tmp_path)),
                     lower_tier=tier) as m:
            e = m.register_engine(reg)
            m.save(e.engine_id, [ChunkBlocks(chunk_key("a"), [0, 1])])
            assert m.flush_dram().submitted.objects == 1
            tier._generation = HUGE_GENERATION + 1025  # what recovering a planted record used to set
            assert tier.submit(key(1), segment(1)) is False
            m.save(e.engine_id, [ChunkBlocks(chunk_key("b"), [2, 3])])
            f = m.flush_dram()
            assert (f.submitted.objects, f.dropped.objects) == (0, 1)
            s = tier.snapshot()
            assert s.write_generations_exhausted_total == 2 and s.write_errors_total == 0
            assert m.lookup(e.engine_id, [chunk_key("a")], lease=False).count == 1
    finally:
        pages.close()
