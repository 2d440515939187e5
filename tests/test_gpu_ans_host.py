"""The host part of the GPU engine's ANS encode batches (packed slots, the download cut and its tail fetch,
headers with their own stored lengths), with the worker's CUDA calls recorded and nvCOMP's payload lengths set
as the kernels leave them. Needs cupy (the engine module imports it), not a GPU."""

from __future__ import annotations

import threading
import types
from collections import Counter

import ml_dtypes
import numpy as np
import pytest
from gpu_fakes import InFlight

pytest.importorskip("cupy")

from orbitkv_fs.gpu import engine as E  # noqa: E402
from orbitkv_fs.segment import RawReason, Role, parse_header  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


class _Worker(InFlight):
    """The save Worker's interface with no CUDA behind it: uploads and launches do nothing, a flight finishes
    when the engine asks (collect, or place when two are in flight)."""

    def __init__(self) -> None:
        self.lock, self.stats, self.inflight = threading.Lock(), Counter(), []
        self.stream = self.copies = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
        self.buffers = [np.zeros(32 << 20, np.uint8) for _ in range(2)]

    def wait_for_current(self) -> None:
        pass

    def place(self, nbytes: int):
        self.make_room()
        buf = self.buffers[len(self.inflight)]
        return 1 << 40, types.SimpleNamespace(get=lambda n: buf[:n])

    def h2d(self, *a) -> None:
        pass

    d2h = handoff = h2d

    def launch(self, *a) -> None:
        pass

    def launched(self, base, nbytes, upload, finish, last=None):
        return self.track(E._Flight(0, nbytes, 0, None, finish))


@pytest.mark.parametrize("short", [False, True])
def test_ans_encode_host_part_packs_slots_and_fetches_a_short_downloads_tail(short, monkeypatch):
    """The host part of an ANS encode batch (no GPU: the worker's CUDA calls recorded, nvCOMP's payload lengths
    set as the kernels leave them): the ANS slots follow one another (header and payload rounded up to the
    alignment) from the batch's first ANS slot, after the other segments' worst-case slots, one over its
    capacity takes no room and is stored raw; each header carries its own stored length under a valid CRC;
    the download stops at the previous batch's packed share plus the margin, and a batch that packs beyond it
    fetches the rest once."""
    rng = np.random.default_rng(int(short))
    log: list = []
    monkeypatch.setattr(E, "_pinned_array", lambda n: np.zeros(max(n, 1), np.uint8))
    monkeypatch.setattr(E.km, "launch_ans_place", lambda *a: log.append(("place",) + a[1:5]) or 1)
    monkeypatch.setattr(E.cp.cuda.runtime, "memcpyAsync", lambda *a: log.append(("copy",) + a[:4]))
    monkeypatch.setattr(E.GpuCodecEngine, "_host_source",
                        lambda self, p: np.zeros(p.n, np.uint8).view(p.dtype).reshape(p.shape or (-1,)))
    eng = object.__new__(E.GpuCodecEngine)
    eng.budget_bytes, eng.seed, eng._classes, eng._rows, eng._class_sets = 256 << 20, 7, {}, {}, {}
    eng._ans_packed = 0.1 if short else 1.0
    eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
    eng.save = _Worker()
    eng.save.fetch = lambda dst, src, n: log.append(("tail", dst, src, n))  # the worker's own stream: see Worker.fetch
    eng._nvcomp = types.SimpleNamespace(max_compressed_bytes=lambda n, t: n + 1500,
                                        compress_temp_bytes=lambda *a: 8192, compress=lambda *a: None)
    shapes = [(int(rng.integers(16, 160)), 8, 128) for _ in range(12)]
    codecs = ["ans" if i % 4 else "fp8" for i in range(12)]
    items = [E.EncodeItem(E.DeviceSpan((1 << 41) + (i << 24), int(np.prod(s)) * 2, s), c, Role.KEY, i, BF16)
             for i, (s, c) in enumerate(zip(shapes, codecs))]
    lengths = {i: (int(it.array.nbytes * rng.uniform(0.5, 0.8)) + 7) // 8 * 8 for i, it in enumerate(items)}
    lengths[5] = 0  # nvCOMP failed it (the packing kernel writes 0 and flags it): raw, no room
    finish = E.GpuCodecEngine._finish_encode

    def with_lengths(self, plans, job, off, host, region, region_len, ans, sink):
        at = off["pay_len"] - off["meta"]
        host[at:at + 8 * len(ans)] = np.array([lengths[p.i] for p in ans], dtype="<u8").view(np.uint8)
        meta = host[:16 * len(plans)].view(E.km.META_DTYPE)
        meta["status"][[p.meta for p in ans if lengths[p.i] == 0]] = E.km.ST_ANS_FAILED
        log.append(("off", dict(off)))
        return finish(self, plans, job, off, host, region, region_len, ans, sink)

    monkeypatch.setattr(E.GpuCodecEngine, "_finish_encode", with_lengths)
    region = np.zeros(32 << 20, np.uint8)
    out = eng.encode_batch(items, out_region=lambda n: region[:n], slot_align=512)
    off = next(e[1] for e in log if e[0] == "off")
    region_len = off["region_end"] - off["meta"]
    assert off["download"] < region_len if short else off["download"] == region_len  # the first batch: all
    tails = [e for e in log if e[0] == "tail"]
    assert len(tails) == int(short) and not [e for e in log if e[0] == "copy"]  # none on the batches' streams
    placed = [(i, E.host_address(s) - region.ctypes.data, len(s)) for i, s in enumerate(out) if isinstance(s, memoryview)]
    ans_slots = [(a, n) for i, a, n in placed if codecs[i] == "ans"]
    assert ans_slots[0][0] == off["ans_slot0"]
    for (a, n), (b, _) in zip(ans_slots, ans_slots[1:]):
        assert b - a == -(-n // 512) * 512
    assert all(a < off["ans_slot0"] for i, a, _ in placed if codecs[i] != "ans")
    end = ans_slots[-1][0] + -(-ans_slots[-1][1] // 512) * 512
    if short:  # the tail: from the end of the download to the end of the packed slots
        assert tails[0][1] - region.ctypes.data == off["download"] and off["download"] + tails[0][3] == end
    for i, a, n in placed:
        h = parse_header(bytes(region[a:a + 64]))  # its header CRC holds
        assert n == 64 + h.stored_length and (codecs[i] != "ans" or h.stored_length == lengths[i])
    assert isinstance(out[5], bytes) and parse_header(out[5][:64]).raw_reason == RawReason.UNSUPPORTED
    assert 0 < eng._ans_packed < 1
