"""The cuFile direct path's CPU-side pieces: the record layout laid into arrays equals the staging layout,
``submit_device`` and ``read_many_device`` over host arrays (same slot, generation, commit and corruption
machinery as the device path), and the Manager's choice of complete vs fragmented state groups."""

from __future__ import annotations

import types

import numpy as np
import pytest

from orbitkv_fs.keys import chunk_key, pack_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.segment import HEADER_SIZE, Role, parse_header
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import (BLOCK, RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, Kind, ShardKey,
                                         check_segment_body, lay_record, pack_record_header_into,
                                         parse_record_header, record_header, record_length, verify_record_head,
                                         verify_record_tag, write_record_body)
from orbitkv_fs.tiers.ssd.recovery import Fate, recover_shard
from orbitkv_fs.errors import SegmentError
from orbitkv_fs.segment import crc32c
from save_rows import rows_of
from test_ssd_common import direct_io_dir, flip, key, segment, shard_key


@pytest.mark.parametrize("n", [16, 1000, (BLOCK - RECORD_HEADER_SIZE - HEADER_SIZE) // 2, 35000])
def test_lay_record_equals_the_staging_layout(n):
    seg = segment(n, n=n)
    k, gen, off, prev = key(3), 12345, 7 * BLOCK, (3 * BLOCK, b"p" * 16)
    sk = ShardKey(bytes(range(32)))
    rec_len = record_length(len(seg))
    staged = memoryview(bytearray(b"\xaa" * (rec_len + BLOCK)))  # a reused buffer: old bytes everywhere
    assert write_record_body(staged, seg) == rec_len
    tag = pack_record_header_into(staged, sk, Kind.SEGMENT, k.pack(), gen, len(seg), off, *prev)
    arr = np.full(rec_len + BLOCK, 0xAA, dtype=np.uint8)
    header, dtag = record_header(sk, Kind.SEGMENT, k.pack(), gen, seg[:HEADER_SIZE], len(seg), off, *prev)
    assert dtag == tag
    assert lay_record(arr, np.frombuffer(seg, np.uint8), header) == rec_len
    assert arr[:rec_len].tobytes() == bytes(staged[:rec_len])
    image = arr[:rec_len].tobytes()
    rh = parse_record_header(image)
    verify_record_tag(image, sk)
    check_segment_body(rh, image[RECORD_HEADER_SIZE:])
    assert (rh.key, rh.generation, rh.offset, rh.prev_offset, rh.prev_tag, rh.tag) == (k, gen, off, *prev, tag)
    crc = int.from_bytes(seg[24:28], "little")
    verify_record_head(image[:RECORD_HEAD_BYTES], off, k.pack(), gen, len(seg), crc)
    for bad in ((off, key(4).pack(), gen, crc), (off + BLOCK, k.pack(), gen, crc), (off, k.pack(), gen + 1, crc),
                (off, k.pack(), gen, crc ^ 1)):
        with pytest.raises(SegmentError):
            verify_record_head(image[:RECORD_HEAD_BYTES], *bad[:3], len(seg), bad[3])
    with pytest.raises(SegmentError):  # and the tag under another secret
        verify_record_tag(image, ShardKey(bytes(32)))


def _tier(tmp_path, **kw) -> tuple[SsdTier, str]:
    d = direct_io_dir(tmp_path)
    path = str(d / "direct.okv")
    return SsdTier(SsdConfig(paths=(path,), capacity=8 << 20, **kw)), path


def test_submit_device_writes_the_io_uring_record(tmp_path):
    t, path = _tier(tmp_path)
    with t:
        assert not t.device_io  # io_uring here: the Manager would not use the direct path
        assert t.submit(key(0), segment(0))
        assert t.submit_device(key(1), np.frombuffer(segment(1), np.uint8))
        t.flush()
        recs = {o.key: o for o in t.iter_records()}
        st = t.snapshot()
        assert (st.write_device_total, st.write_device_bytes_total) == (1, record_length(len(segment(1))))
        assert t.read_many([key(0), key(1)]) == [segment(0), segment(1)]
        with open(path, "rb") as f:
            image = f.read()
        o = recs[key(1)]
        on_disk = parse_record_header(image[o.offset:o.offset + RECORD_HEADER_SIZE])
        assert (on_disk.prev_offset, on_disk.prev_tag) == (recs[key(0)].offset,
                                                           parse_record_header(image[recs[key(0)].offset:]).tag)
        want = np.zeros(record_length(len(segment(1))), np.uint8)
        header, _ = record_header(shard_key(path), Kind.SEGMENT, key(1).pack(), o.generation, segment(1)[:HEADER_SIZE],
                                  len(segment(1)), o.offset, on_disk.prev_offset, on_disk.prev_tag)
        lay_record(want, np.frombuffer(segment(1), np.uint8), header)
        assert image[o.offset:o.offset + want.size] == want.tobytes()
        assert [r.fate for r in recover_shard(image).records] == [Fate.LIVE, Fate.LIVE]
        with pytest.raises(SegmentError):
            t.submit_device(key(2), np.frombuffer(segment(2), np.uint8)[:-1])
    with SsdTier(SsdConfig(paths=(path,), capacity=8 << 20, recover=True)) as t:
        assert t.read(key(1)) == segment(1)


def test_a_segment_on_disk_is_not_written_again(tmp_path):
    t, _ = _tier(tmp_path)
    with t:
        assert t.submit_device(key(0), np.frombuffer(segment(0), np.uint8))
        t.flush()
        before = t.snapshot().write_submitted_total
        assert t.submit(key(0), segment(0))  # DRAM evicting its copy: already on disk
        st = t.snapshot()
        assert (st.write_submitted_total, st.write_already_stored_total) == (before, 1)
        assert t.submit(key(0), segment(0, version=1))  # other bytes: written
        t.flush()
        assert t.snapshot().write_submitted_total == before + 1
        assert t.read(key(0)) == segment(0, version=1)
        assert t.submit(key(0), segment(0, version=1))  # nor is a record the io_uring path wrote
        st = t.snapshot()
        assert (st.write_submitted_total, st.write_already_stored_total) == (before + 1, 2)


def _host_crc_sink(calls: list):
    """A stand-in for the GPU decode: checks each payload's CRC32C, returns the indices that fail."""

    def sink(batch):
        calls.append([(i, v.tobytes()) for i, v in batch])
        bad = []
        for i, v in batch:
            h = parse_header(v[:HEADER_SIZE].tobytes())
            if crc32c(v[HEADER_SIZE:HEADER_SIZE + h.stored_length].tobytes()) != h.payload_crc:
                bad.append(i)
        return bad

    return sink


def test_read_many_device_windows_corruption_and_leases(tmp_path):
    t, path = _tier(tmp_path)
    with t:
        for i in range(8):
            assert t.submit(key(i), segment(i))
        t.flush()
        recs = {o.key: o for o in t.iter_records()}
        flip(path, recs[key(2)].offset + RECORD_HEADER_SIZE + HEADER_SIZE + 9)  # payload: found downstream
        flip(path, recs[key(5)].offset + 50)  # record header: found by the tier
        assert t.describe([key(1), key(9)]) == [(8192 * 2, len(segment(1))), None]
        calls: list = []
        keys = [key(i) for i in range(8)] + [key(9)]
        got = t.read_many_device(keys, _host_crc_sink(calls), max_bytes=3 * BLOCK * 5)
        assert got == [None, None, "corrupt", None, None, "corrupt", None, None, "absent"]
        assert len(calls) > 1  # windows of max_bytes
        delivered = dict(x for c in calls for x in c)
        for i in (0, 1, 3, 4, 6, 7):
            assert delivered[i] == segment(i)
        assert 5 not in delivered  # a bad record header never reaches the consumer
        st = t.snapshot()
        assert st.corrupt_records_total == 2 and st.read_device_total == 6
        assert not t.contains(key(2)) and not t.contains(key(5)) and t.contains(key(3))
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values())
        assert t._demand == 0
        assert t.submit(key(2), segment(2))  # resubmitting repairs it
        t.flush()
        assert t.read_many_device([key(2)], _host_crc_sink([])) == [None]


def test_read_many_device_sink_failure_gives_leases_back(tmp_path):
    t, _ = _tier(tmp_path)
    with t:
        t.submit(key(0), segment(0))
        t.flush()

        def boom(batch):
            raise RuntimeError("consumer failed")

        with pytest.raises(RuntimeError):
            t.read_many_device([key(0)], boom)
        assert all(s.leases == 0 for sh in t._shards for s in sh.slots.values()) and t._demand == 0
        assert t.read(key(0)) == segment(0)


class _DeviceTier:
    """A lower tier that claims device I/O and records what the direct path submits."""

    name = "fake-ssd"
    device_io = True

    def __init__(self) -> None:
        self.direct: list = []

    def submit_device(self, k, segment, *, timeout: float = 0.0) -> bool:
        self.direct.append(k)
        return True


def test_only_complete_state_groups_go_straight_to_the_ssd():
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
        lower = _DeviceTier()
        m.lower = lower
        ns = bytes(16)
        segs = [types.SimpleNamespace(layer=layer, role=role) for layer in range(2) for role in (Role.KEY, Role.VALUE)]
        eng = types.SimpleNamespace(info=types.SimpleNamespace(device="cuda:0"), segs=segs)
        a, b, c = (ChunkBlocks(chunk_key(x), [0]) for x in "abc")
        # a: every segment in the batch; b: split over batches (its last segment is elsewhere); c: whole
        batch = ([(a, s, pack_key(ns, a.key, s.layer, s.role)) for s in segs]
                 + [(b, s, pack_key(ns, b.key, s.layer, s.role)) for s in segs[:3]]
                 + [(c, s, pack_key(ns, c.key, s.layer, s.role)) for s in segs])
        assert m._ssd_direct_sink(eng, rows_of(batch, segs)) == (None, set())  # no GPU codec engine: never
        m._gpu_codecs = object()  # what _ssd_direct checks for; nothing is encoded here
        try:
            sink, written = m._ssd_direct_sink(eng, rows_of(batch, segs))
            for i in range(len(batch)):
                sink(i, b"device bytes")
            assert written == set(range(4)) | set(range(7, 11))
            assert {k.chunk for k in lower.direct} == {a.key, c.key}
            host = types.SimpleNamespace(info=types.SimpleNamespace(device="host"), segs=segs)
            assert m._ssd_direct_sink(host, rows_of(batch, segs)) == (None, set())  # host pages: DRAM and io_uring
            lower.device_io = False
            assert m._ssd_direct_sink(eng, rows_of(batch, segs)) == (None, set())  # io_uring backend
        finally:
            m._gpu_codecs = None
            m.lower = None
