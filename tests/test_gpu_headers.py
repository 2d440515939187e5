"""A save flight's headers as the GPU engine writes them (``orbitkv_fs.gpu.headers.write_headers``, numba; no
cupy, so CI runs it): for random headers of every format, payload CRCs and ANS stored lengths, slots on
header-size boundaries or not, and segments in any order of their request, the bytes are ``pack_header``'s,
the admitted fields are the header's own, and nothing outside the 64-byte slots changes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from orbitkv_fs.gpu.headers import ANS_ROW, HEADER_ROW_DTYPE, write_headers, write_headers_model
from orbitkv_fs.segment import (HEADER_SIZE, AnsType, Format, RawReason, Role, SegmentHeader, header_row,
                                pack_header, parse_header)



def _classes(rng: np.random.Generator) -> tuple[list[SegmentHeader], list[SegmentHeader]]:
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    out = [SegmentHeader(Format.FP8, bf16, 4096, 2048, 0, role=Role.KEY, layer=7, bits=8),
           SegmentHeader(Format.TURBOQUANT, bf16, 4096, 1088, 0, role=Role.VALUE, layer=3, bits=4, head_dim=128,
                         sign_version=1, rotation_seed=int(rng.integers(1 << 32))),
           SegmentHeader(Format.RAW, bf16, 8192, 8192, 0, role=Role.VALUE, layer=35, raw_reason=RawReason.POLICY),
           SegmentHeader(Format.RAW, np.dtype(np.float16), 4096, 4096, 0, role=Role.KEY, layer=1)]
    ans = [SegmentHeader(Format.ANS, dt, 65536, 40000, 0, role=Role.KEY, layer=int(rng.integers(80)),
                         ans_type=AnsType.FLOAT16) for dt in (bf16, np.dtype(np.float16))]
    return out, ans


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("with_ans", [False, True])
def test_written_headers_are_pack_headers_bytes(seed, aligned, with_ans):
    rng = np.random.default_rng(seed)
    plain, ans = _classes(rng)
    classes = plain + (ans if with_ans else [])
    made = [header_row(h) for h in classes]
    templates = np.stack([r.view(np.uint8).reshape(HEADER_SIZE) for r, _ in made])
    bases = np.array([c for _, c in made], dtype=np.uint32)
    n = int(rng.integers(1, 300))
    tid = rng.integers(len(classes), size=n).astype(np.intp)
    pcrc = rng.integers(1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    pcrc[: min(n, 3)] = [0, 0xFFFFFFFF, 1][: min(n, 3)]
    lens = np.array([classes[t].stored_length for t in tid], dtype=np.int64)
    if with_ans:  # an ANS payload's length is what nvCOMP made of it: anything up to the class's capacity
        is_ans = np.array([classes[t].format == Format.ANS for t in tid])
        lens[is_ans] = rng.integers(1, 65536, size=int(is_ans.sum()))
    gap = rng.integers(0, 3, size=n) * (HEADER_SIZE if aligned else 1) + (0 if aligned else rng.integers(1, 7, size=n))
    step = HEADER_SIZE + (-(-lens // HEADER_SIZE) * HEADER_SIZE if aligned else lens) + gap
    slots = HEADER_SIZE + np.cumsum(step) - step
    assert (slots % HEADER_SIZE == 0).all() == aligned or n == 1
    fill = np.uint8(rng.integers(256))
    host = np.full(int(HEADER_SIZE + step.sum()), fill, np.uint8)
    k = n + 3
    fields = (np.full(k, -1, np.int16), np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.uint8),
              np.zeros(k, np.int64))
    idx = rng.permutation(k)[:n].astype(np.int64)  # the segments' places in their request
    write_headers(host, templates, bases, tid, pcrc, slots, idx, fields, lens if with_ans else None)
    fmt, original, length, reason, addr = fields
    for j in range(n):
        want = msgspec.structs.replace(classes[tid[j]], payload_crc=int(pcrc[j]), stored_length=int(lens[j]))
        got = bytes(host[slots[j]:slots[j] + HEADER_SIZE])
        assert got == pack_header(want), (j, classes[tid[j]].format)
        assert parse_header(got) == want
        i = idx[j]
        assert (fmt[i], original[i], length[i], reason[i]) == (int(want.format), want.original_length,
                                                                HEADER_SIZE + want.stored_length, int(want.raw_reason))
        assert addr[i] == host.ctypes.data + slots[j]
    outside = np.ones(host.size, dtype=bool)
    outside[slots[:, None] + np.arange(HEADER_SIZE)] = False
    assert (host[outside] == fill).all()
    untouched = np.setdiff1d(np.arange(k), idx)
    assert (fmt[untouched] == -1).all() and (addr[untouched] == 0).all()


@pytest.mark.parametrize("bad", ["slot past the end", "negative slot", "template", "place"])
def test_out_of_range_rows_raise_and_write_nothing(bad):
    """A slot whose header would pass the region's end (or start before it), a template id that is not one, or
    a place outside the job: IndexError, and neither the region nor the fields changed (the numba loop runs
    without bounds checks, so it checks every row before it writes any)."""
    rng = np.random.default_rng(7)
    plain, _ = _classes(rng)
    made = [header_row(h) for h in plain]
    templates = np.stack([r.view(np.uint8).reshape(HEADER_SIZE) for r, _ in made])
    bases = np.array([c for _, c in made], dtype=np.uint32)
    n = 5
    host = np.full(n * 128, 0x5A, np.uint8)
    slots, tid, idx = np.arange(n, dtype=np.int64) * 128, np.zeros(n, np.intp), np.arange(n, dtype=np.int64)
    pcrc = np.arange(n, dtype=np.uint32)
    {"slot past the end": lambda: slots.__setitem__(4, host.size - HEADER_SIZE + 1),
     "negative slot": lambda: slots.__setitem__(4, -1),
     "template": lambda: tid.__setitem__(4, len(templates)),
     "place": lambda: idx.__setitem__(4, n)}[bad]()
    fields = (np.full(n, -1, np.int16), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.uint8),
              np.zeros(n, np.int64))
    with pytest.raises(IndexError, match="header 4"):
        write_headers(host, templates, bases, tid, pcrc, slots, idx, fields)
    assert (host == 0x5A).all() and (fields[0] == -1).all() and not fields[4].any()
    with pytest.raises(ValueError):
        write_headers(host, templates, bases, tid, pcrc[:-1], slots, idx, fields)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_ans", [False, True])
def test_the_kernels_header_model_writes_pack_headers_bytes(seed, with_ans):
    """okv_write_headers' host model writes, at each row's slot, the header pack_header gives for the payload CRC
    finish_crc makes of that row's Meta.acc and walked bytes (the tables' ends too), and nothing outside the
    rows' slots. An ANS row (``ANS_ROW``) names the region offset of its payload length: its header goes to the
    slot its Meta row's pad0 holds, with that length as its stored length and walked bytes; a zero length (a
    failed segment) or one over its template's capacity writes no header at all."""
    from orbitkv_fs.gpu.tables import finish_crc

    rng = np.random.default_rng(seed)
    plain, ans_classes = _classes(rng)
    classes = plain + (ans_classes if with_ans else [])
    made = [header_row(h) for h in classes]
    templates = np.stack([r.view(np.uint8).reshape(HEADER_SIZE) for r, _ in made])
    bases = np.array([c for _, c in made], dtype=np.uint32)
    n = int(rng.integers(1, 80))
    tid = rng.integers(len(classes), size=n)
    walked = np.array([classes[t].stored_length for t in tid], dtype=np.int64)
    walked[: min(n, 2)] = [0, 2049 * 16384 - 1][: min(n, 2)]  # the table's ends
    is_ans = np.array([classes[t].format == Format.ANS for t in tid])
    lens = np.where(is_ans, rng.integers(1, 40001, size=n), walked)
    lens[is_ans & (rng.random(n) < 0.2)] = 0  # failed: okv_ans_pack's zero length
    lens[is_ans & (rng.random(n) < 0.1)] = 40001  # over the capacity
    pay0 = 16 * n
    region = np.full(pay0 + 8 * n + (n + 1) * 4 * HEADER_SIZE, 0xA5, np.uint8)
    acc = rng.integers(1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    region[:16 * n].view("<u4")[0::4] = acc
    rows = np.empty(n, HEADER_ROW_DTYPE)
    slot = pay0 + 8 * n + 4 * HEADER_SIZE * rng.permutation(n)
    rows["slot"], rows["tid"], rows["meta"], rows["walked"] = slot, tid, np.arange(n), walked
    if is_ans.any():
        region[:16 * n].view("<u4")[2::4][is_ans] = slot[is_ans]
        a = np.flatnonzero(is_ans)
        at = pay0 + 8 * np.arange(len(a))
        region[pay0:pay0 + 8 * len(a)] = lens[a].astype("<u8").view(np.uint8)
        rows["slot"][a], rows["walked"][a] = at, ANS_ROW
    write_headers_model(region, rows, templates, bases)
    written = ~is_ans | ((lens > 0) & (lens <= 40000))
    pcrc = finish_crc(acc, lens)
    for j in np.flatnonzero(written).tolist():
        s = int(slot[j])
        want = msgspec.structs.replace(classes[tid[j]], payload_crc=int(pcrc[j]))
        if is_ans[j]:
            want = msgspec.structs.replace(want, stored_length=int(lens[j]))
        assert bytes(region[s:s + HEADER_SIZE]) == pack_header(want), j
    outside = np.ones(region.size, dtype=bool)
    outside[:pay0 + 8 * n] = False
    outside[slot[written][:, None] + np.arange(HEADER_SIZE)] = False
    assert (region[outside] == 0xA5).all()


def test_fields_only_leaves_the_region_alone():
    """write_headers without payload CRCs (the GPU wrote the headers): the admitted fields are the templates'
    (with the stored lengths given, ANS's, each segment's length from its own), the region is not touched."""
    rng = np.random.default_rng(5)
    plain, _ = _classes(rng)
    made = [header_row(h) for h in plain]
    templates = np.stack([r.view(np.uint8).reshape(HEADER_SIZE) for r, _ in made])
    bases = np.array([c for _, c in made], dtype=np.uint32)
    host = np.full(8 * HEADER_SIZE, 0x3C, np.uint8)
    tid = np.array([2, 0, 1], np.intp)
    slots = np.array([0, 2, 5], np.int64) * HEADER_SIZE
    fields = (np.zeros(3, np.int16), np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.uint8),
              np.zeros(3, np.int64))
    write_headers(host, templates, bases, tid, None, slots, np.arange(3), fields)
    assert (host == 0x3C).all()
    fmt, original, length, reason, addr = fields
    for j, t in enumerate(tid):
        h = plain[t]
        assert (fmt[j], original[j], length[j], reason[j]) == (int(h.format), h.original_length,
                                                                HEADER_SIZE + h.stored_length, int(h.raw_reason))
        assert addr[j] == host.ctypes.data + slots[j]
    stored = np.array([7, 900, 31], np.int64)
    write_headers(host, templates, bases, tid, None, slots, np.arange(3), fields, stored)
    assert (host == 0x3C).all() and np.array_equal(length, HEADER_SIZE + stored)
