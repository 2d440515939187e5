"""The GPU engine's host-side batch planning: its descriptor rows (built column by column) against the
kernels' row type filled field by field (``SEG_DTYPE``), over random mixed batches of every codec (what each
field must hold for each kernel is written out here once more, independently of the packing code); its batch
cuts against the per-segment fit rule; its header rows against ``pack_header``. Needs cupy (the engine module
imports it), not a GPU."""

from __future__ import annotations

import collections
import contextlib
import gc
import random
import types
import weakref

import ml_dtypes
import numpy as np
import pytest
from gpu_fakes import InFlight

pytest.importorskip("cupy")

from orbitkv_fs.gpu import ans_format  # noqa: E402
from orbitkv_fs.gpu import engine as E  # noqa: E402
from orbitkv_fs.gpu import module as km  # noqa: E402
from orbitkv_fs.gpu.tables import sign_words, zero_crc  # noqa: E402
from orbitkv_fs.gpu.headers import write_headers_model  # noqa: E402
from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, AnsType, Format, Role, SegmentHeader, pack_header  # noqa: E402
from orbitkv_fs.segment import turboquant_stored_bytes  # noqa: E402

FP16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)


def reference(rows: list[dict]) -> np.ndarray:
    a = np.zeros(len(rows), km.SEG_DTYPE)
    for i, r in enumerate(rows):
        for k, v in r.items():
            a[k][i] = v
    return a


def grouped(groups) -> tuple[list[dict], dict]:
    """Rows of each (kernel, [(segment, fields)]) group, block0 running within the group."""
    rows, firsts = [], {}
    for name, items in groups:
        first, block = len(rows), 0
        for meta, fields in items:
            rows.append({"block0": block, "meta": meta, **fields})
            block += fields["nblocks"]
        firsts[name] = (first, len(items), block)
    return rows, firsts


@pytest.mark.parametrize("seed", range(20))
def test_encode_rows(seed):
    rng = random.Random(seed)
    plans = [types.SimpleNamespace(
        kind=rng.choice(["raw", "fp8", "tq", "ans"]), meta=i, ptr=rng.getrandbits(40), n=rng.randrange(1, 1000) * 4096,
        dtype=rng.choice([FP16, BF16]), role=rng.choice([Role.KEY, Role.VALUE]), layer=rng.randrange(40),
        head_dim=rng.choice([64, 128]), bits=rng.choice([3, 4]), cap=rng.randrange(1, 10**6), slot=rng.getrandbits(22),
        nch=rng.randrange(1, 70), chunk0=rng.randrange(1000), tmp=rng.getrandbits(22)) for i in range(rng.randrange(1, 40))]
    tseed, base = rng.getrandbits(32), rng.getrandbits(40)
    region, chunk_cap = base + rng.getrandbits(20), rng.randrange(1, 100000)
    off = {"pay_len": 1000, "chunk_sizes": 2000, "chunk_status": 3000}
    by = {k: [p for p in plans if p.kind == k] for k in ("raw", "fp8", "tq", "ans")}
    tqk = [p for p in by["tq"] if p.role == Role.KEY]
    tqv = [p for p in by["tq"] if p.role != Role.KEY]
    crc = [p for p in plans if p.kind in ("raw", "tq")]
    out = {id(p): region + p.slot + HEADER_SIZE for p in plans}

    def tq(p):
        return {"src": p.ptr, "dst": out[id(p)], "n": p.n, "dtype": int(p.dtype == FP16), "head_dim": p.head_dim,
                "bits": p.bits, "role": int(p.role), "signs": sign_words(p.head_dim, p.layer, tseed),
                "nblocks": km.units_tq(p.n, p.head_dim)}

    def ans(j, p):
        pay = base + off["pay_len"] + 8 * j
        return {"src": base + p.tmp, "dst": out[id(p)], "n": p.n, "n_dev": base + off["chunk_sizes"] + 8 * p.chunk0,
                "st_dev": base + off["chunk_status"] + 4 * p.chunk0, "expect_crc": chunk_cap, "bits": p.cap,
                "signs": (pay & 0xFFFFFFFF, pay >> 32, 0, 0, 0, 0, 0, 0), "nblocks": p.nch}

    def check(p):
        src, dst, n = (p.ptr, out[id(p)], p.n) if p.kind == "raw" else (out[id(p)], 0, p.cap)
        return {"src": src, "dst": dst, "n": n, "nblocks": km.units_bytes(n)}

    groups = [("okv_fp8_encode", [(p.meta, {"src": p.ptr, "dst": out[id(p)], "n": p.n, "dtype": int(p.dtype == FP16),
                                             "nblocks": km.units_fp8(p.n)}) for p in by["fp8"]]),
              ("okv_tq_encode_k", [(p.meta, tq(p)) for p in tqk]), ("okv_tq_encode_v", [(p.meta, tq(p)) for p in tqv]),
              ("okv_ans_pack", [(p.meta, ans(j, p)) for j, p in enumerate(by["ans"])]),
              ("okv_crc32c", [(p.meta, check(p)) for p in crc])]
    rows, firsts = grouped([g for g in groups if g[1]])
    buf = np.full(128 + 128 * len(rows) + 64, 0xEE, np.uint8)
    cols = E._enc_cols(plans)
    groups = E._enc_groups(cols, np.array([p.meta for p in by["ans"]], dtype=np.int64))
    assert [(name, sel.tolist()) for name, sel in groups] == [
        (name, [p.meta for p in plist]) for name, plist in (("okv_fp8_encode", by["fp8"]), ("okv_tq_encode_k", tqk),
                                                            ("okv_tq_encode_v", tqv), ("okv_ans_pack", by["ans"]),
                                                            ("okv_crc32c", crc))]
    got = E._encode_rows(buf, 128, cols, groups, region + HEADER_SIZE, tseed, chunk_cap, base, off)
    assert got == {k: (f, b) for k, (f, _, b) in firsts.items()}
    assert np.array_equal(buf[128:128 + 128 * len(rows)], reference(rows).view(np.uint8))
    assert (buf[:128] == 0xEE).all() and (buf[128 + 128 * len(rows):] == 0xEE).all()  # nothing outside the rows


def _header(rng: random.Random, kind: str, most: int = 1000) -> SegmentHeader:
    dt, orig = rng.choice([FP16, BF16]), rng.randrange(1, most) * 4096
    role, layer, crc = rng.choice([Role.KEY, Role.VALUE]), rng.randrange(40), rng.getrandbits(32)
    if kind == "raw":
        return SegmentHeader(Format.RAW, dt, orig, orig, crc, role=role, layer=layer)
    if kind == "fp8":
        return SegmentHeader(Format.FP8, dt, orig, orig // 2, crc, role=role, layer=layer, bits=8)
    if kind == "tq":
        bits, hd = rng.choice([3, 4]), rng.choice([64, 128])
        return SegmentHeader(Format.TURBOQUANT, dt, orig, turboquant_stored_bytes(orig, hd, bits, role), crc, role=role,
                             layer=layer, bits=bits, head_dim=hd, sign_version=1, rotation_seed=rng.getrandbits(32))
    return SegmentHeader(Format.ANS, dt, orig, orig // 3, crc, role=role, layer=layer, ans_type=AnsType.FLOAT16)


@pytest.mark.parametrize("seed", range(20))
def test_decode_rows(seed):
    rng = random.Random(seed)
    plans = []
    for i in range(rng.randrange(1, 40)):
        kind = rng.choice(["raw", "fp8", "tq", "ans"])
        plans.append(types.SimpleNamespace(kind=kind, h=_header(rng, kind), meta=i, staged=rng.getrandbits(20),
                                           dst=types.SimpleNamespace(ptr=rng.getrandbits(40)),
                                           scratch=rng.getrandbits(20), chunk0=rng.randrange(100)))
    base = rng.getrandbits(40)
    actual, status = base + 4096, base + 8192
    # the kernels' CRC accumulators end at the header's CRC32C without its zero-byte part
    expect = [p.h.payload_crc ^ int(zero_crc(p.h.stored_length)) for p in plans]
    fp8 = [p for p in plans if p.kind == "fp8"]
    tq = [p for p in plans if p.kind == "tq"]
    copy = [p for p in plans if p.kind in ("raw", "ans")]

    def src(p):
        return base + p.staged

    def common(p):
        h = p.h
        return {"dst": p.dst.ptr, "n": h.original_length, "dtype": int(h.dtype == FP16), "expect_crc": expect[p.meta]}

    def copied(p):
        h = p.h
        f = {**common(p), "nblocks": km.units_bytes(h.original_length)}
        if p.kind == "raw":
            return {**f, "src": src(p)}
        return {**f, "src": base + p.scratch, "n_dev": actual + 8 * p.chunk0, "st_dev": status + 4 * p.chunk0,
                "head_dim": ans_format.CHUNK_BYTES}

    groups = [("okv_crc32c", [(p.meta, {"src": src(p), "n": p.h.stored_length, "expect_crc": expect[p.meta],
                                         "nblocks": km.units_bytes(p.h.stored_length)}) for p in plans]),
              ("okv_fp8_decode", [(p.meta, {**common(p), "src": src(p), "nblocks": km.units_fp8(p.h.original_length)})
                                  for p in fp8]),
              ("okv_tq_decode", [(p.meta, {**common(p), "src": src(p), "head_dim": p.h.head_dim, "bits": p.h.bits,
                                           "role": int(p.h.role),
                                           "signs": sign_words(p.h.head_dim, p.h.layer, p.h.rotation_seed),
                                           "nblocks": km.units_tq(p.h.original_length, p.h.head_dim)}) for p in tq]),
              ("okv_copy_checked", [(p.meta, copied(p)) for p in copy])]
    rows, firsts = grouped(groups)
    buf = np.full(256 + 128 * len(rows), 0xEE, np.uint8)
    cols = E._plan_cols(plans, np.array([src(p) for p in plans], dtype=np.int64), base)
    assert E._decode_rows(buf, 256, cols, actual, status) == firsts
    assert np.array_equal(buf[256:], reference(rows).view(np.uint8))
    assert (buf[:256] == 0xEE).all()
    # The columnar path reads the same columns from the header bytes (all but ANS's, which it refuses).
    plain = [p for p in plans if p.kind != "ans"]
    if plain:
        heads = np.frombuffer(b"".join(pack_header(p.h) for p in plain), np.uint8).view(HEADER_DTYPE)
        srcs = np.array([src(p) for p in plain], dtype=np.int64)
        want = E._plan_cols(plain, srcs, base)
        got = E._header_cols(heads, srcs, np.array([p.dst.ptr for p in plain], dtype=np.int64))
        for name in want._fields:
            assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_mirror_keeps_neighbours_in_one_copy():
    """Payloads that lie one after another in pinned memory are staged at the same relative offsets (one
    upload per run), as the object path's layout stages them; the others each at the next aligned offset."""
    rng = random.Random(5)
    for _ in range(50):
        k = rng.randrange(1, 30)
        stored = np.array([rng.randrange(1, 5000) for _ in range(k)], dtype=np.int64)
        host, a = [], rng.getrandbits(30) * 64 + 64
        for n in stored.tolist():
            host.append(a)
            step = rng.choice([E._up(n + 64), E._up(n + 64) + 256, n + rng.randrange(2000), 10**6])
            a += step if rng.random() < 0.9 else -(10**5)
        host = np.array(host, dtype=np.int64)
        lay = E._Layout()
        lay.take(1000)
        staged, runs = E._mirror(host, stored, lay)
        ref = E._Layout()
        ref.take(1000)
        plans = [types.SimpleNamespace(i=j, inplace=False, h=types.SimpleNamespace(stored_length=int(n)), staged=0)
                 for j, n in enumerate(stored.tolist())]
        prev = None  # the rule of GpuCodecEngine._dec_layout for payloads that all go up from pinned memory
        for p, ha in zip(plans, host.tolist()):
            if prev is not None and (ha - prev[1]) % E.SLOT_ALIGN == 0 and 0 <= ha - prev[1] - prev[0].h.stored_length <= E._MIRROR_GAP:
                p.staged = prev[0].staged + (ha - prev[1])
                ref.end = p.staged + p.h.stored_length
            else:
                p.staged = ref.take(p.h.stored_length)
            prev = (p, ha)
        assert staged.tolist() == [p.staged for p in plans] and lay.end == ref.end
        assert [a for a, _ in runs] == [0] + [j for j in range(1, k) if staged[j] - staged[j - 1] != host[j] - host[j - 1]
                                              or not (0 <= host[j] - host[j - 1] - stored[j - 1] <= E._MIRROR_GAP)
                                              or (host[j] - host[j - 1]) % E.SLOT_ALIGN]
        assert runs[-1][1] == k and all(b == a2 for (_, b), (a2, _) in zip(runs, runs[1:]))


def test_fill_plus_is_add_of_one_plain_segment():
    """The fit checks' one-tuple step: the same totals as adding a non-ANS segment's own, after ANS ones."""
    rng = random.Random(3)
    fill = E._Fill()
    for _ in range(200):
        n = rng.randrange(1, 1 << 24)
        if rng.random() < 0.3:
            one = E._Fill.of(n, rng.randrange(1, 64), n, rng.choice([AnsType.BYTES, AnsType.FLOAT16]))
            fill = fill.add(one)
            continue
        assert fill.plus(n) == fill.add(E._Fill.of(n))
        fill = fill.plus(n)
    assert fill.k == 200 and fill.ans > 0


def _greedy(plans, one, fits):
    """The per-segment rule of encode_submit / decode_submit: a plan joins the open batch while the batch
    stays within its bound (``fits``), else the batch closes and the plan opens the next one."""
    out, batch, fill = [], [], E._Fill()
    for p in plans:
        more = fill.plus(one(p))
        if len(batch) < E.MAX_BATCH and fits(more):
            batch.append(p)
            fill = more
            continue
        out.append(batch)
        batch, fill = [p], E._Fill.of(one(p))
    if batch:
        out.append(batch)
    return out


def _check_even(got, want, one, fits):
    """``got`` is the per-segment rule's ``want`` evened out: as many batches, the same plans in the same order,
    each within its bound, none holding more than an equal share of the bytes plus one plan (the rule's last
    batch may be a sliver: a Manager batch of two flights' bytes was one full flight and a short one)."""
    assert len(got) == len(want)
    assert [id(p) for b in got for p in b] == [id(p) for b in want for p in b]
    sizes = [one(p) for b in want for p in b]
    share = sum(sizes) / len(got)
    for b in got:
        fill = E._Fill()
        for p in b:
            fill = fill.plus(one(p))
        assert b and len(b) <= E.MAX_BATCH and fits(fill)
        if len(got) > 1 and len(want[-1]) < E.MAX_BATCH:
            assert fill.bytes <= share + max(sizes)


def _bare_engine(budget: int) -> "E.GpuCodecEngine":
    eng = object.__new__(E.GpuCodecEngine)  # no device: only the planning arithmetic is used
    eng.budget_bytes, eng._dec_plans = budget, {}
    return eng


@pytest.mark.parametrize("seed", range(12))
def test_plain_encode_batches_are_the_per_segment_rule_evened_out(seed):
    rng = random.Random(seed)
    eng = _bare_engine(rng.choice([1 << 20, 8 << 20, 64 << 20, 256 << 20]))
    align = rng.choice([E.SLOT_ALIGN, 4096])
    size = rng.choice([32 << 10, 512 << 10, 4 << 20])
    plans = [types.SimpleNamespace(kind=rng.choice(["raw", "fp8", "tq"]), n=size * rng.choice([1, 1, 2]),
                                   cap=size // rng.choice([2, 3, 4])) for _ in range(rng.randrange(1, 900))]
    got = eng._plain_batches(plans, align)

    def slot(p):
        return E._up(E.HEADER_SIZE + (p.n if p.kind == "raw" else p.cap), align)

    half = eng.budget_bytes // 2
    if any(eng._enc_estimate(E._Fill.of(slot(p)), align) > half for p in plans):
        assert got is None
        return
    fits = lambda f: eng._enc_estimate(f, align) <= half  # noqa: E731
    _check_even(got, _greedy(plans, slot, fits), slot, fits)


@pytest.mark.parametrize("seed", range(12))
def test_plain_decode_batches_are_the_per_segment_rule_evened_out(seed):
    rng = random.Random(seed)
    eng = _bare_engine(rng.choice([1 << 20, 8 << 20, 64 << 20, 256 << 20]))
    size = rng.choice([32 << 10, 512 << 10, 4 << 20])
    plans = [types.SimpleNamespace(kind=rng.choice(["raw", "fp8", "tq"]),
                                   h=types.SimpleNamespace(stored_length=size // rng.choice([1, 2, 3])))
             for _ in range(rng.randrange(1, 900))]
    got = eng._plain_dec_batches(plans)
    half = eng.budget_bytes // 2
    if any(eng._dec_estimate(E._Fill.of(E._dec_staging(p))) > half for p in plans):
        assert got is None
        return
    fits = lambda f: eng._dec_estimate(f) <= half  # noqa: E731
    _check_even(got, _greedy(plans, E._dec_staging, fits), E._dec_staging, fits)


def test_plain_batches_leave_host_encodes_to_the_per_segment_rule():
    eng = _bare_engine(64 << 20)
    plans = [types.SimpleNamespace(kind="raw", n=4096, cap=0), types.SimpleNamespace(kind="host", n=4096, cap=4096)]
    assert eng._plain_batches(plans, E.SLOT_ALIGN) is None
    assert eng._plain_dec_batches([types.SimpleNamespace(kind="ans", h=None)]) is None


@pytest.mark.parametrize("seed", range(12))
def test_even_batches_are_as_many_and_each_fits(seed):
    """_prefix_batches(even=True): as many batches as the greedy cut, every row once and in order, each batch
    within the limit and MAX_BATCH, none holding more than an equal share of the bytes plus one row (the
    greedy cut's last batch may hold a sliver)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 3000))
    sizes = rng.integers(1 << 10, 1 << 21, k) if seed % 3 else np.full(k, 1 << 19)
    fixed, extra = E._enc_fixed(E.SLOT_ALIGN), int(rng.integers(0, 8 << 20))
    limit = int(sizes.max()) + extra + (8 << 20) + int(rng.integers(0, 128 << 20))
    greedy = E._prefix_batches(np.arange(k), sizes, fixed, limit, extra)
    even = E._prefix_batches(np.arange(k), sizes, fixed, limit, extra, even=True)
    assert len(even) == len(greedy) and np.array_equal(np.concatenate(even), np.arange(k))
    share = sizes.sum() / len(even)
    for b in even:
        assert 0 < len(b) <= E.MAX_BATCH
        assert int(fixed(np.array([len(b)]))[0]) + extra + int(sizes[b].sum()) <= limit
        if len(even) > 1 and len(greedy[-1]) < E.MAX_BATCH:
            assert sizes[b].sum() <= share + sizes.max()


def _greedy_then_even(k, sizes, tab, limit, even):
    """_prefix_batches' rule written out plainly: the greedy cut, then (``even``) the same count at equal shares
    of the bytes where that fits."""
    ends = np.cumsum(sizes)
    out, start = [], 0
    while start < k:
        count = 1
        while (start + count < k and count < E.MAX_BATCH
               and tab[count] + ends[start + count] - (ends[start - 1] if start else 0) <= limit):
            count += 1
        out.append(np.arange(start, start + count))
        start += count
    if even and len(out) > 1:
        m = len(out)
        cuts = [0] + [int(np.searchsorted(ends, ends[-1] * j / m)) + 1 for j in range(1, m)] + [k]
        parts = [np.arange(a, b) for a, b in zip(cuts, cuts[1:])]
        if all(0 < len(p) <= E.MAX_BATCH and tab[len(p) - 1] + sizes[p].sum() <= limit for p in parts):
            return parts
    return out


@pytest.mark.parametrize("seed", range(40))
def test_prefix_batches_are_the_greedy_rule_then_even_shares(seed):
    """_prefix_batches (which skips the greedy pass where the least count the bytes allow fits at equal shares)
    answers what the greedy cut and then the even one give, on loose and tight limits, equal and mixed sizes."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 1500))
    sizes = rng.integers(1 << 10, 1 << 20, k) if seed % 2 else np.full(k, (1 << 19) + 256)
    fixed = E._enc_fixed(E.SLOT_ALIGN)
    tab = fixed(np.arange(1, E.MAX_BATCH + 1, dtype=np.int64))
    total = int(sizes.sum())
    # from one segment alone to all of them in one batch, including just at the edges of k equal shares
    limit = int(sizes.max() + tab[0]) + int(rng.choice([0, 1, total // int(rng.integers(1, 5)), total]))
    if seed % 4 == 3 and k <= E.MAX_BATCH:  # every byte fits one batch, but not with the fixed part of k rows
        limit = int(tab[k - 1] + total) - 1
    for even in (False, True):
        got = E._prefix_batches(np.arange(k), sizes, fixed, limit, even=even)
        want = _greedy_then_even(k, sizes, tab, limit, even)
        assert [b.tolist() for b in got] == [b.tolist() for b in want]


def test_zero_crc_of_many_new_lengths_at_once():
    """zero_crc computes the lengths it has not seen together; every value is crc32c of that many zeros."""
    import crc32c

    from orbitkv_fs.gpu.tables import zero_crc

    rng = random.Random(5)
    for _ in range(3):
        ns = np.array([rng.randrange(0, 1 << 22) for _ in range(40)] + [0, 1, 64, 65536], dtype=np.int64)
        ns = np.concatenate([ns, ns[:7]])  # repeats within one call
        assert zero_crc(ns).tolist() == [crc32c.crc32c(bytes(int(n))) for n in ns]
    assert zero_crc(np.array([[3, 4]])).shape == (1, 2) and int(zero_crc(5)) == crc32c.crc32c(bytes(5))


@pytest.mark.parametrize("align", [1, HEADER_SIZE])
def test_encode_headers_are_pack_headers_bytes(align):
    """The engine's header writer (template rows per field tuple, the payload and header CRCs and fields
    written by numba, slots on header-size boundaries or not): every format, several payload CRCs
    per template, more tuples than a batch has: the bytes are pack_header's, nothing outside the header
    slots is touched; invalid fields raise as pack_header does."""
    from orbitkv_fs import errors
    from orbitkv_fs.segment import RawReason, dtype_code, pack_header

    kinds = [(Format.FP8, BF16, 4096, 2048, Role.KEY, 7, 8, 0, 0, 0, AnsType.NONE, RawReason.NONE),
             (Format.TURBOQUANT, BF16, 4096, 1088, Role.VALUE, 3, 4, 128, 1, 99, AnsType.NONE, RawReason.NONE),
             (Format.ANS, BF16, 65536, 40000, Role.KEY, 0, 0, 0, 0, 0, AnsType.FLOAT16, RawReason.NONE),
             (Format.ANS, FP16, 65536, 40008, Role.KEY, 0, 0, 0, 0, 0, AnsType.FLOAT16, RawReason.NONE),
             (Format.RAW, BF16, 4096, 4096, Role.VALUE, 35, 0, 0, 0, 0, AnsType.NONE, RawReason.POLICY)]
    heads, want = [], []
    for crc in (0, 1, 0xDEADBEEF):
        for fmt, dtype, orig, stored, role, layer, bits, hd, sv, seed, at, reason in kinds:
            heads.append((int(fmt), dtype_code(dtype), orig, stored, int(role), layer, bits, hd, sv, seed, int(at),
                          int(reason)))
            want.append(pack_header(SegmentHeader(fmt, dtype, orig, stored, crc, role=role, layer=layer, bits=bits,
                                                  head_dim=hd, sign_version=sv, rotation_seed=seed, ans_type=at,
                                                  raw_reason=reason)))
    crcs = np.array([c for c in (0, 1, 0xDEADBEEF) for _ in kinds], dtype=np.uint32)
    eng = _bare_engine(64 << 20)
    eng._rows = {}
    tids, rows, bases = eng._template_ids(heads)
    n = len(heads)
    stored = np.array([h[3] for h in heads], dtype=np.int64)
    step = -(-(HEADER_SIZE + stored + HEADER_SIZE) // align) * align  # each slot with a gap after it
    assert bool((step % HEADER_SIZE).any()) == (align == 1)
    slots = HEADER_SIZE + np.cumsum(step) - step
    host = np.full(int(HEADER_SIZE + step.sum()), 0xAB, np.uint8)
    job = E.EncodeJob.of(n + 2)
    idx = np.arange(n, dtype=np.int64)[::-1] + 1  # the segments' places in their request
    length = E._write_headers(job, host, rows, bases, tids, crcs, slots, idx, views=True)
    for j, w in enumerate(want):
        assert bytes(host[slots[j]:slots[j] + HEADER_SIZE]) == w, kinds[j % len(kinds)]
    outside = np.ones(host.size, dtype=bool)
    outside[slots[:, None] + np.arange(HEADER_SIZE)] = False
    assert (host[outside] == 0xAB).all()
    # the job's fields are the headers' own, at each segment's place; its views start at the slots
    assert length.tolist() == (HEADER_SIZE + stored).tolist()
    assert job.fmt[idx].tolist() == [h[0] for h in heads] and job.original[idx].tolist() == [h[2] for h in heads]
    assert job.length[idx].tolist() == length.tolist() and job.reason[idx].tolist() == [h[11] for h in heads]
    assert job.addr[idx].tolist() == (host.ctypes.data + slots).tolist()
    assert job.fmt[[0, n + 1]].tolist() == [-1, -1] and job.out[0] is None and job.out[n + 1] is None
    for j, i in enumerate(idx.tolist()):
        v = job.out[i]
        assert len(v) == length[j] and bytes(v[:HEADER_SIZE]) == want[j]
    with pytest.raises(errors.LengthMismatch):  # a raw header whose stored length is not its source's
        eng._template_ids([(int(Format.RAW), dtype_code(np.dtype(np.uint8)), 4, 5, 0, 0, 0, 0, 0, 0, 0, 0)])


class _RecordingWorker:
    """A Worker's interface recording what a decode batch sends to the GPU (the upload buffer's bytes, the
    copies from pinned memory, the launches): no CUDA behind it, flights never finish."""

    def __init__(self) -> None:
        import threading
        from collections import Counter

        self.lock, self.stats, self.log = threading.Lock(), Counter(), []
        self.stream = self.copies = types.SimpleNamespace(ptr=0)
        self.buffers = [np.zeros(32 << 20, np.uint8) for _ in range(2)]
        self.n = 0

    def wait_for_current(self) -> None:
        pass

    def place(self, nbytes: int):
        buf = self.buffers[self.n % 2]
        self.n += 1
        buf[:nbytes] = 0xEE  # what a reused pinned buffer holds: a byte not written is sent as this
        return 1 << 40, types.SimpleNamespace(get=lambda n, b=buf: b[:n])

    def h2d(self, dst: int, src: np.ndarray, stream=None) -> None:
        self.log.append(("h2d", dst, src.tobytes()))

    def h2d_raw(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self.log.append(("h2d_raw", dst, src, nbytes))

    def d2h(self, *a) -> None:
        pass

    def handoff(self, *a) -> None:
        pass

    def launch(self, k, name, segs, nsegs, total, meta, table=None) -> None:
        self.log.append(("launch", name, segs, nsegs, total, meta))

    def launched(self, base, nbytes, upload, finish, last=None):
        return E._Flight(0, nbytes, 0, None, finish)


class _RecordingNvcomp:
    def __init__(self, log: list) -> None:
        self.log = log

    def decompress_temp_bytes(self, chunks: int, chunk: int, total: int, t) -> int:
        return 4096 + 16 * chunks + total // 64

    def decompress(self, *args) -> None:
        self.log.append(("nvcomp",) + args[:-1])


def _ans_arena(rng: np.random.Generator, k: int) -> "tuple[np.ndarray, list, list[int]]":
    """``k`` ANS segments (random chunk bytes: their tables are what is read here) one after another in a
    uint8 array as a save batch leaves them in the arena (slots 512 bytes apart), mixed ANS types."""
    arena = np.zeros(k * (300 << 10), np.uint8)
    views, offs, pos = [], [], 0
    for i in range(k):
        orig = int(rng.integers(1, 5) * ans_format.CHUNK_BYTES - 8 * rng.integers(0, 600))
        chunks = [rng.integers(0, 256, int(rng.integers(100, 40000)), dtype=np.uint8)
                  for _ in range(ans_format.chunk_count(orig))]
        payload = ans_format.pack(chunks)
        t = AnsType.FLOAT16 if i % 3 else AnsType.BYTES
        h = SegmentHeader(Format.ANS, BF16 if t == AnsType.FLOAT16 else np.dtype(np.uint8), orig, len(payload),
                          int(rng.integers(0, 1 << 32)), role=Role.KEY, layer=i, ans_type=t)
        blob = pack_header(h) + payload
        arena[pos:pos + len(blob)] = np.frombuffer(blob, np.uint8)
        views.append(memoryview(arena)[pos:pos + len(blob)])
        offs.append(pos)
        pos = -(-(pos + len(blob)) // 512) * 512
    return arena, views, offs


def _recording_engine() -> "E.GpuCodecEngine":
    eng = _bare_engine(64 << 20)
    eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
    eng.restore = _RecordingWorker()
    eng._nvcomp = _RecordingNvcomp(eng.restore.log)
    return eng


@pytest.mark.parametrize("seed", range(6))
def test_ans_decode_as_arrays_sends_what_the_item_path_sends(seed, monkeypatch):
    """decode_columns_submit of ANS segments in an arena (chunk tables parsed in one pass from it) uploads the
    same descriptors and chunk arrays, copies the same runs of payloads and makes the same nvCOMP calls as the
    per-segment decode_submit of the same segments; a damaged chunk table is the same typed error in both,
    and the other segments still go."""
    monkeypatch.setattr(E, "_pinned_array", lambda n: np.zeros(max(n, 1), np.uint8))
    rng = np.random.default_rng(seed)
    arena, views, offs = _ans_arena(rng, 9)
    if seed % 2:  # a damaged table: chunk count off by one
        arena[offs[4] + HEADER_SIZE + 4] += 1
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs])
    h = heads.view(HEADER_DTYPE).reshape(-1)
    orig = h["original_length"].astype(np.int64)
    dst = (1 << 42) + np.cumsum(orig) - orig
    # the item path sorts the ANS types apart; feed both paths the same segments type-sorted so their scratch
    # (laid out in batch order by the item path, in type order by the array path) can be compared
    order = np.argsort(h["ans_type"], kind="stable")
    item = _recording_engine()
    job_i = item.decode_submit([views[j] for j in order],
                               [E.DeviceSpan(int(dst[j]), int(orig[j]), (int(orig[j]),)) for j in order],
                               pinned=[True] * len(order))
    cols = _recording_engine()
    src = arena.ctypes.data + np.asarray(offs, dtype=np.int64)[order] + HEADER_SIZE
    job_c = cols.decode_columns_submit(heads[order], src, dst[order], orig[order], within=arena)
    assert job_c is not None
    assert [type(r) for r in job_c.results] == [type(r) for r in job_i.results]
    assert [str(r) for r in job_c.results] == [str(r) for r in job_i.results]
    assert (seed % 2 == 1) == any(r is not None for r in job_c.results)
    assert cols.restore.log == item.restore.log
    assert sum(e[0] == "nvcomp" for e in cols.restore.log) == 2  # one call per ANS type
    assert cols.decode_columns_submit(heads[order], src, dst[order], orig[order]) is None  # no arena: items
    odd = heads[order].copy()
    odd[2, HEADER_DTYPE.fields["format"][1]] = 9  # a format the GPU does not decode: the items path decides
    assert cols.decode_columns_submit(odd, src, dst[order], orig[order], within=arena) is None


@pytest.mark.parametrize("seed", range(4))
def test_in_place_ans_decode_points_nvcomp_at_the_destinations(seed, monkeypatch):
    """decode_columns_submit(in_place=True) of ANS segments: nvCOMP's output pointers are each chunk's place in
    its segment's destination, within its decoded length; no checked copy is launched; the flight holds no
    scratch for the decoded bytes; the payloads staged, the nvCOMP calls otherwise and the verdicts (a damaged
    table's typed error) are those of the scratch path."""
    monkeypatch.setattr(E, "_pinned_array", lambda n: np.zeros(max(n, 1), np.uint8))
    rng = np.random.default_rng(100 + seed)
    arena, _, offs = _ans_arena(rng, 9)
    if seed % 2:
        arena[offs[4] + HEADER_SIZE + 4] += 1  # a damaged table: that segment is never sent
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs])
    h = heads.view(HEADER_DTYPE).reshape(-1)
    orig = h["original_length"].astype(np.int64)
    dst = (1 << 42) + np.cumsum(orig + 4096) - orig
    src = arena.ctypes.data + np.asarray(offs, dtype=np.int64) + HEADER_SIZE
    scratch, in_place = _recording_engine(), _recording_engine()
    job_s = scratch.decode_columns_submit(heads, src, dst, orig, within=arena)
    job_p = in_place.decode_columns_submit(heads, src, dst, orig, within=arena, in_place=True)
    assert [str(r) for r in job_p.results] == [str(r) for r in job_s.results]
    assert (seed % 2 == 1) == isinstance(job_p.results[4], E.LengthMismatch)
    assert len(job_p.flights) == len(job_s.flights) == 1

    def launches(eng):
        return [x[1] for x in eng.restore.log if x[0] == "launch"]

    assert "okv_copy_checked" in launches(scratch) and "okv_copy_checked" not in launches(in_place)
    sent = [i for i in range(len(offs)) if job_p.results[i] is None]
    room = sum(-(-int(orig[i]) // E.SLOT_ALIGN) * E.SLOT_ALIGN for i in sent)
    assert job_s.flights[0].end - job_p.flights[0].end >= room  # no scratch in the in-place flight
    log = in_place.restore.log
    up = next(x for x in log if x[0] == "h2d")
    buf, base = np.frombuffer(up[2], np.uint8), up[1]
    calls = [x for x in log if x[0] == "nvcomp"]
    assert len(calls) == sum(x[0] == "nvcomp" for x in scratch.restore.log) >= 1
    cb = ans_format.CHUNK_BYTES
    for c in calls:  # (in ptrs, in bytes, out bytes, actual, chunks, temp, temp bytes, out ptrs, type)
        n, t = c[5], c[9]
        outs = buf[c[8] - base:c[8] - base + 8 * n].view("<u8").astype(np.int64)
        out_bytes = buf[c[3] - base:c[3] - base + 8 * n].view("<u8").astype(np.int64)
        want = [(int(dst[i]) + cb * j, min(cb, int(orig[i]) - cb * j)) for i in sent if h["ans_type"][i] == t
                for j in range(ans_format.chunk_count(int(orig[i])))]
        assert list(zip(outs.tolist(), out_bytes.tolist())) == want


@pytest.mark.parametrize("seed", range(10))
def test_temp_batches_hold_their_own_temp(seed):
    """_temp_batches: consecutive batches covering every row in order, each within the limit once its own
    temp (here growing with its bytes, as nvCOMP's does with chunks and bytes) is counted; None when a row
    cannot fit beside its temp."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1 << 10, 1 << 20, int(rng.integers(1, 300)))
    fixed = E._dec_fixed
    limit = int(rng.integers(2 << 20, 64 << 20))

    def temp_of(b: np.ndarray) -> int:
        return 4096 + int(sizes[b].sum()) // 4

    batches = E._temp_batches(sizes, fixed, limit, temp_of)  # a row and its temp always fit 2 MiB here
    assert batches is not None and np.array_equal(np.concatenate(batches), np.arange(len(sizes)))
    for b in batches:
        assert int(fixed(np.array([len(b)]))[0] + sizes[b].sum()) + temp_of(b) <= limit
    assert E._temp_batches(sizes, fixed, int(sizes.max()), temp_of) is None


class _RecordingSaveWorker(InFlight, _RecordingWorker):
    """The save side: flights kept until finished (two in flight at most, as the Worker's place does), the
    downloads recorded by size."""

    def __init__(self) -> None:
        super().__init__()
        self.inflight: list = []

    def place(self, nbytes: int):
        self.make_room()
        return super().place(nbytes)

    def d2h(self, dst: np.ndarray, src: int, stream=None) -> None:
        self.log.append(("d2h", src, dst.nbytes))

    def fetch(self, dst: int, src: int, nbytes: int) -> None:  # a download's tail, past the packed share guessed
        self.log.append(("fetch", src, nbytes))

    def launched(self, base, nbytes, upload, finish, last=None):
        return self.track(super().launched(base, nbytes, upload, finish, last))


@pytest.mark.parametrize("seed", range(10))
def test_ans_rounds_cut_a_batch_into_consecutive_rounds(seed):
    """_ans_rounds: every ANS segment in one round, in order; a round as long as its chunks fit the limit (a wider
    segment alone), so each round ends where the next segment would not fit; per round one nvCOMP call per run
    of one type, the calls covering the round's chunks; each segment's chunk buffers from zero within its round;
    the buffers, the largest round."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 200))
    nch = rng.integers(1, 70, k)
    types = np.sort(rng.choice([0, 1, 2], k))
    limit = int(rng.integers(1, 400))
    r = E._ans_rounds(nch, types, limit)
    chunk0 = np.cumsum(nch) - nch
    assert np.array_equal(r.chunk0, chunk0)
    assert r.rounds[0][0] == 0 and r.rounds[-1][1] == k
    for (lo, hi, chunks, calls), nxt in zip(r.rounds, r.rounds[1:] + [None]):
        assert chunks == nch[lo:hi].sum() and (chunks <= limit or hi == lo + 1)
        if nxt is not None:
            assert nxt[0] == hi and chunks + nch[hi] > limit
        assert np.array_equal(r.at[lo:hi], chunk0[lo:hi] - chunk0[lo])
        assert [c[1] for c in calls] == [chunk0[lo]] + [chunk0[lo] + sum(c[2] for c in calls[:i]) for i in
                                                         range(1, len(calls))]
        assert sum(c[2] for c in calls) == chunks
        assert [int(c[0]) for c in calls] == [int(t) for t in dict.fromkeys(types[lo:hi].tolist())]
    assert r.chunks == max(x[2] for x in r.rounds)


def _check_rounds(log: list, cap: int, half: int) -> int:
    """What a save's encode batches sent (a recording worker's log) against the ANS round rules: each round's
    nvCOMP calls cover its segments' chunks, whose output buffers lie one after another from one base shared by
    every round of the batch, ``cap`` bytes apart; then okv_ans_place and okv_ans_pack over the round's rows
    (consecutive, work units counted from zero within the round), the place carrying the batch's one u64 after
    its payload lengths; each batch within ``half``. Answers the number of rounds seen."""
    base, rounds = 1 << 40, 0
    batches = [i for i, e in enumerate(log) if e[0] == "h2d"] + [len(log)]
    for b0, b1 in zip(batches, batches[1:]):
        up = np.frombuffer(log[b0][2], np.uint8)
        assert len(up) <= half
        calls, bufs, carries, pays, placed = [], set(), set(), [], 0
        for e in log[b0 + 1:b1]:
            if e[0] == "nvcomp":
                calls.append(e)
            elif e[0] == "place":
                _, segs, nsegs, _, _, carry = e
                rows = np.frombuffer(up, E.km.SEG_DTYPE, count=nsegs, offset=segs - base)
                assert rows["block0"][0] == 0
                assert np.array_equal(rows["block0"][1:], np.cumsum(rows["nblocks"])[:-1])
                chunks = int(rows["nblocks"].sum())
                # this round's calls: its chunks, in order, their outputs where the rows read them
                n_dev = int(rows["n_dev"][0])
                got = [(c[8] - n_dev) // 8 for c in calls]  # first chunk of each call, from the round's first
                assert got[0] == 0 and sum(c[4] for c in calls) == chunks
                assert got == np.cumsum([0] + [c[4] for c in calls])[:-1].tolist()
                assert np.array_equal(rows["n_dev"] - n_dev, 8 * rows["block0"].astype(np.uint64))
                first = calls[0]
                outs = np.frombuffer(up, "<u8", count=chunks, offset=first[7] - base)
                assert np.array_equal(np.diff(outs.astype(np.int64)), np.full(chunks - 1, cap))
                assert np.array_equal(rows["src"], outs[rows["block0"]])
                bufs.add(int(outs[0]))
                pays.append(int(rows["signs"][0, 0]) + (int(rows["signs"][0, 1]) << 32))  # its first length's
                placed += nsegs
                carries.add(carry)
                calls, rounds = [], rounds + 1
        assert len(bufs) <= 1 and len(carries) <= 1  # every round of a batch: the same buffers, the same carry
        if pays:  # the carry: the u64 right after the batch's last payload length
            assert carries == {pays[0] + 8 * placed}, (carries, pays, placed)
    return rounds


class _HeaderKernelSaveWorker(_RecordingSaveWorker):
    """:class:`_RecordingSaveWorker` whose ``okv_write_headers`` launch runs its host model
    (``headers.write_headers_model``) on the flight's region when the flight downloads it: the header bytes an
    H200 would bring. ``consts`` stands for ``GpuCodecEngine._header_consts``: its arrays by fake address."""

    def __init__(self, deferred: bool = False) -> None:
        super().__init__()
        self.arrays: dict[int, np.ndarray] = {}
        self.pending = None
        self.kernels = 0
        self.deferred = deferred  # the caller runs the model (``apply``) on the flight's whole region

    def consts(self, cs, c, plan) -> tuple[int, int, int]:
        got = (E._header_rows(c, plan), np.ascontiguousarray(cs.templates), cs.bases.astype(np.uint32))
        for a in got:
            self.arrays[a.ctypes.data] = a
        return tuple(a.ctypes.data for a in got)

    def write_headers(self, k, rows: int, n: int, region: int, templates: int, bases: int) -> None:
        assert self.pending is None and len(self.arrays[rows]) == n
        self.pending = (self.arrays[rows], self.arrays[templates], self.arrays[bases])
        self.kernels += 1

    def d2h(self, dst: np.ndarray, src: int, stream=None) -> None:
        super().d2h(dst, src, stream)
        if not self.deferred:
            self.apply(dst)

    def apply(self, region: np.ndarray) -> None:
        if self.pending is not None:
            write_headers_model(region, *self.pending)
            self.pending = None


def _two_arenas():
    """Two 64 MiB arenas and ``region_of(j)``: an ``out_region`` that hands out arena j's bytes in order, each
    region at the next 4 KiB (the item and the column path of one comparison, one arena each)."""
    arenas = [np.zeros(64 << 20, np.uint8) for _ in range(2)]
    used = [0, 0]

    def region_of(j):
        def region(nb):
            r = arenas[j][used[j]:used[j] + nb]
            used[j] = -(-(used[j] + nb) // 4096) * 4096
            return r
        return region

    return arenas, region_of


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [256 << 20, 4 << 20], ids=["one-round", "rounds"])
def test_ans_encode_as_arrays_sends_what_the_item_path_sends(seed, budget, monkeypatch):
    """encode_columns_submit of a save batch with ANS segments (bytes and 16-bit: two nvCOMP types; exact and FP8
    among them) uploads the same descriptors and chunk arrays, launches the same kernels, makes the same nvCOMP
    and okv_ans_place calls and downloads as much as the per-segment encode_submit of the same sources; given
    the same payload lengths from nvCOMP (one of them over its capacity: stored raw), both answer the same
    segments at the same places of their regions, headers byte for byte: the item path's written by the host,
    the column path's by okv_write_headers (its model here, from the lengths and the slots okv_ans_pack leaves in
    the region). A second batch of the same classes at other addresses reuses the flights' plans and answers
    the same again. With a 4 MiB workspace a batch's ANS segments are compressed in rounds that reuse one set
    of chunk buffers (``_check_rounds``)."""
    monkeypatch.setattr(E, "_pinned_array", lambda n: np.zeros(max(n, 1), np.uint8))
    rng = np.random.default_rng(seed)
    sizes_of = {}  # a source's payload length as nvCOMP would give it, by its index in the batch

    active: dict = {}  # the log of the engine now encoding
    monkeypatch.setattr(E.km, "launch_ans_place", lambda k, segs, nsegs, ans0, align, carry, stream:
                        active["log"].append(("place", segs, nsegs, ans0, align, carry)) or 1)

    def item_lengths(finish):
        def run(self, plans, job, off, host, *args, **kw):
            at = off["pay_len"] - off["meta"]
            size = [sizes_of[p.i] if sizes_of[p.i] <= p.head[3] else 0 for p in args[2]]  # okv_ans_pack's: 0 over
            host[at:at + 8 * len(size)] = np.array(size, dtype="<u8").view(np.uint8)  # the capacity (no slot)
            return finish(self, plans, job, off, host, *args, **kw)
        return run

    monkeypatch.setattr(E.GpuCodecEngine, "_finish_encode", item_lengths(E.GpuCodecEngine._finish_encode))
    monkeypatch.setattr(E.GpuCodecEngine, "_host_source",
                        lambda self, p: np.zeros(p.n, np.uint8).view(p.dtype).reshape(p.shape or (-1,)))

    def engine(columns: bool):
        eng = _bare_engine(budget)
        eng.seed, eng._classes, eng._rows, eng._class_sets, eng._plans, eng._ans_packed = 7, {}, {}, {}, {}, 1.0
        eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
        eng.save = _HeaderKernelSaveWorker(deferred=True) if columns else _RecordingSaveWorker()
        eng._nvcomp = types.SimpleNamespace(
            max_compressed_bytes=lambda n, t: n + 1500, compress_temp_bytes=lambda c, cb, total, t: 8192 + 8 * c + t,
            compress=lambda *args: eng.save.log.append(("nvcomp",) + args[:-1]))
        if columns:  # what the GPU leaves in a column flight's region before okv_write_headers: lengths, slots
            eng._header_consts = eng.save.consts
            run, launch = eng._run_encode_columns, eng._launch_encode

            def run_flight(cs, cls, ptrs, rows, *args):
                active["rows"] = rows
                return run(cs, cls, ptrs, rows, *args)

            def launch_flight(base, off, got, groups, k, *args):
                host, own = launch(base, off, got, groups, k, *args)
                a = dict(groups)["okv_ans_pack"]
                size = np.array([sizes_of[i] for i in active["rows"][a].tolist()], dtype=np.int64)
                at = off["pay_len"] - off["meta"]
                ok = size <= np.array([eng._plans_cap[i] for i in active["rows"][a].tolist()])
                size[~ok] = 0  # okv_ans_pack: a payload over its capacity takes no slot, its length zero
                host[at:at + 8 * len(a)] = size.astype("<u8").view(np.uint8)
                steps = np.where(size > 0, -(-(HEADER_SIZE + size) // off["align"]) * off["align"], 0)
                meta = host[:16 * k].view(E.km.META_DTYPE)
                meta["pad0"][a[ok]] = (off["ans_slot0"] + np.cumsum(steps) - steps)[ok]
                eng.save.apply(host)
                return host, own

            eng._run_encode_columns, eng._launch_encode = run_flight, launch_flight
        return eng

    shapes = [(int(rng.integers(16, 160)), 8, 128) for _ in range(5)]  # 32-320 KiB: one to five ANS chunks
    kinds = [("ans", BF16), ("ans", np.dtype(np.uint8)), ("none", BF16), ("fp8", BF16), ("ans", FP16)]
    item_engine, col_engine = engine(False), engine(True)
    classes = [col_engine.encode_class(E.EncodeItem(E.DeviceSpan(0, int(np.prod(s)) * dt.itemsize, s), codec, Role.KEY,
                                                    3, dt)) for s, (codec, dt) in zip(shapes, kinds)]
    cls = rng.integers(0, len(classes), 40)
    col_engine._plans_cap = [classes[c].head[3] for c in cls]  # each source's payload capacity (its template's)
    nbytes = np.array([classes[c].n for c in cls], dtype=np.int64)
    for i, c in enumerate(cls.tolist()):
        n = classes[c].n
        sizes_of[i] = (int(n * rng.uniform(0.5, 0.85)) + 7) // 8 * 8 if i != 5 else n  # i = 5: over the capacity
    arenas, region_of = _two_arenas()
    for second in (False, True):
        ptrs = (1 << 41) + int(second) * (1 << 36) + np.cumsum(nbytes + 4096) - nbytes
        items = [E.EncodeItem(E.DeviceSpan(int(p), int(nbytes[i]), shapes[c]), kinds[c][0], Role.KEY, 3, kinds[c][1])
                 for i, (p, c) in enumerate(zip(ptrs.tolist(), cls.tolist()))]
        item_engine.save.log.clear()
        col_engine.save.log.clear()
        active["log"] = item_engine.save.log
        out_i = item_engine.encode_collect(item_engine.encode_submit(items, out_region=region_of(0), slot_align=512))
        active["log"] = col_engine.save.log
        plans = len(col_engine._plans)
        job = col_engine.encode_columns_submit(classes, cls, ptrs, out_region=region_of(1), slot_align=512)
        assert job is not None
        out_c = col_engine.encode_collect(job)
        assert (len(col_engine._plans) == plans) == second
        assert col_engine.save.log == item_engine.save.log
        assert col_engine.save.kernels == sum(e[0] == "d2h" for e in col_engine.save.log)  # one header launch a flight
        col_engine.save.kernels = 0
        rounds = _check_rounds(col_engine.save.log, E._up(ans_format.CHUNK_BYTES + 1500), budget // 2)
        if budget > 16 << 20:  # one batch, one round: one nvCOMP call per type
            assert sum(e[0] == "nvcomp" for e in col_engine.save.log) == 2 and rounds == 1
        else:
            assert rounds > sum(e[0] == "h2d" for e in col_engine.save.log) > 1
        for i in range(len(items)):
            if out_c[i] is not None:  # a raw fallback (only the one over its capacity, if it is ANS)
                assert bytes(out_c[i]) == bytes(out_i[i]) and i == 5
                continue
            a = int(job.addr[i]) - arenas[1].ctypes.data
            b = E.host_address(out_i[i]) - arenas[0].ctypes.data
            n = int(job.length[i])
            assert a == b and n == len(out_i[i]), i
            assert bytes(arenas[1][a:a + HEADER_SIZE]) == bytes(arenas[0][b:b + HEADER_SIZE]), i
    rules = len(E._FIXED_PARTS)  # the batch rule's table is kept once, not once per save
    col_engine.encode_collect(col_engine.encode_columns_submit(classes, cls, ptrs, slot_align=512))
    assert len(E._FIXED_PARTS) == rules
    flight = next(p for k, (_, p) in col_engine._plans.items() if k[0] != "cuts")
    with pytest.raises(ValueError):
        flight.chunk_fixed[0, 0] = 1


@pytest.mark.parametrize("seed", range(4))
def test_ans_decode_verdicts_as_arrays_are_the_item_paths(seed, monkeypatch):
    """The verdicts of an ANS restore batch decoded as arrays, from what the GPU answers (each segment's CRC
    accumulator, each chunk's nvCOMP status and decoded size), are the item path's for the same answers: a
    payload CRC mismatch first, then a failed chunk (with nvCOMP's status name), then a decoded size that is
    not the header's, else None."""
    got_meta: list = []

    def pinned(n: int) -> np.ndarray:  # the meta downloads, kept to fill as the GPU would
        a = np.zeros(max(n, 1), np.uint8)
        got_meta.append(a)
        return a

    monkeypatch.setattr(E, "_pinned_array", pinned)
    rng = np.random.default_rng(seed)
    arena, views, offs = _ans_arena(rng, 12)
    heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs])
    h = heads.view(HEADER_DTYPE).reshape(-1)
    order = np.argsort(h["ans_type"], kind="stable")
    heads, h = heads[order], h[order]
    orig = h["original_length"].astype(np.int64)
    dst = (1 << 42) + np.cumsum(orig) - orig
    src = arena.ctypes.data + np.asarray(offs, dtype=np.int64)[order] + HEADER_SIZE
    nch = -(-orig // ans_format.CHUNK_BYTES)
    # what the GPU answers: per segment 0 good, 1 CRC mismatch, 2 a failed chunk, 3 a short decode
    fate = rng.integers(0, 4, len(h))
    expect = (h["payload_crc"].astype(np.int64) ^ zero_crc(h["stored_length"].astype(np.int64)).astype(np.int64))
    c0 = np.cumsum(nch) - nch

    def answer(meta: np.ndarray) -> None:
        k, chunks = len(h), int(nch.sum())
        m = meta[:16 * k].view(km.META_DTYPE)
        m["acc"] = np.where(fate == 1, expect ^ 1, expect)
        _, off = E._dec_layout_fixed(k, chunks)
        actual = meta[off["chunk_actual"] - off["meta"]:][:8 * chunks].view("<u8")
        status = meta[off["chunk_status"] - off["meta"]:][:4 * chunks].view("<i4")
        at = E._within(nch)
        actual[:] = np.minimum(ans_format.CHUNK_BYTES, np.repeat(orig, nch) - ans_format.CHUNK_BYTES * at)
        for j in np.flatnonzero(fate == 2).tolist():
            status[c0[j] + int(rng.integers(0, nch[j]))] = 7
        for j in np.flatnonzero(fate == 3).tolist():
            actual[c0[j]] -= 8

    results = []
    for path in ("items", "columns"):
        eng = _recording_engine()
        eng._nvcomp.status_name = lambda st: f"status {st}"
        got_meta.clear()
        if path == "items":
            job = eng.decode_submit([views[j] for j in order],
                                    [E.DeviceSpan(int(d), int(n), (int(n),)) for d, n in zip(dst, orig)],
                                    pinned=[True] * len(h))
        else:
            job = eng.decode_columns_submit(heads, src, dst, orig, within=arena)
        assert len(job.flights) == 1 and len(got_meta) == 1
        answer(got_meta[0])
        job.flights[0].finish()
        results.append([(type(r).__name__, str(r)) if r is not None else None for r in job.results])
    assert results[0] == results[1]
    kinds = [r[0] if r else None for r in results[1]]
    assert kinds == [{0: None, 1: "PayloadChecksumMismatch", 2: "SegmentError", 3: "LengthMismatch"}[f] for f in fate]


@pytest.mark.parametrize("seed", range(4))
def test_planned_flights_send_what_the_item_path_sends(seed, monkeypatch):
    """encode_columns_submit of batches without ANS (exact, FP8, TurboQuant K and V of two widths) plans each flight
    once per class vector (``_flight_plan``) and reuses the plan (``PLANS_KEPT`` of them at most): the first batch, a second of the same classes at
    other addresses (no new plan) and a third of other classes (new plans) each upload the same descriptors,
    launch the same kernels and download as much as the per-segment encode_submit of the same sources, and
    answer the same headers at the same places of their regions. A plan's arrays are read-only."""
    monkeypatch.setattr(E, "_pinned_array", lambda n: np.zeros(max(n, 1), np.uint8))
    made = []
    plan = E._flight_plan
    monkeypatch.setattr(E, "_flight_plan", lambda *a: made.append(a[1].tobytes()) or plan(*a))
    rng = np.random.default_rng(seed)

    def engine():
        eng = _bare_engine(2 << 20)  # flights of 1 MiB: several a batch
        eng.seed, eng._classes, eng._rows, eng._class_sets, eng._plans, eng._ans_packed = 11, {}, {}, {}, {}, 1.0
        eng._kernels = types.SimpleNamespace(crc_tables=None, tq_tables=None)
        eng.save = _HeaderKernelSaveWorker()
        eng._header_consts = eng.save.consts
        return eng

    kinds = [("none", BF16, Role.KEY, 128), ("fp8", BF16, Role.VALUE, 128), ("turboquant-4", BF16, Role.KEY, 128),
             ("turboquant-4", BF16, Role.VALUE, 128), ("turboquant-3", FP16, Role.KEY, 64)]
    shapes = [(int(rng.integers(4, 40)), 8, d) for *_, d in kinds]
    item_engine, col_engine = engine(), engine()
    classes = [col_engine.encode_class(E.EncodeItem(E.DeviceSpan(0, int(np.prod(s)) * dt.itemsize, s), codec, role,
                                                    3 + j, dt)) for j, (s, (codec, dt, role, _)) in enumerate(zip(shapes, kinds))]
    arenas, region_of = _two_arenas()

    first = rng.integers(0, len(classes), 60)
    for cls, new in ((first, True), (first, False), (rng.permutation(first), True)):
        nbytes = np.array([classes[c].n for c in cls], dtype=np.int64)
        ptrs = int(rng.integers(1, 1 << 20)) * 4096 + (1 << 41) + np.cumsum(nbytes + 4096) - nbytes
        items = [E.EncodeItem(E.DeviceSpan(int(p), int(nbytes[i]), shapes[c]), kinds[c][0], kinds[c][2], 3 + c,
                              kinds[c][1]) for i, (p, c) in enumerate(zip(ptrs.tolist(), cls.tolist()))]
        item_engine.save.log.clear()
        col_engine.save.log.clear()
        before = len(made)
        out_i = item_engine.encode_collect(item_engine.encode_submit(items, out_region=region_of(0), slot_align=512))
        job = col_engine.encode_columns_submit(classes, cls, ptrs, out_region=region_of(1), slot_align=512)
        assert job is not None
        assert all(x is None for x in col_engine.encode_collect(job))
        assert (len(made) > before) == new
        assert col_engine.save.log == item_engine.save.log and col_engine.save.log
        # the column path's headers come from okv_write_headers (its model here), one launch per flight
        assert col_engine.save.kernels == sum(e[0] == "d2h" for e in col_engine.save.log)
        assert item_engine.save.kernels == 0
        col_engine.save.kernels = 0
        for i in range(len(items)):
            a = int(job.addr[i]) - arenas[1].ctypes.data
            b = E.host_address(out_i[i]) - arenas[0].ctypes.data
            n = int(job.length[i])
            assert a == b and n == len(out_i[i]), i
            assert bytes(arenas[1][a:a + HEADER_SIZE]) == bytes(arenas[0][b:b + HEADER_SIZE]), i
    flight = next(p for k, (_, p) in col_engine._plans.items() if k[0] != "cuts")
    with pytest.raises(ValueError):
        flight.slots[0] = 1
    for _ in range(E.PLANS_KEPT + 8):  # class vectors never seen again: the engine keeps PLANS_KEPT plans at most
        col_engine.encode_collect(col_engine.encode_columns_submit(classes, rng.permutation(first), ptrs))
        assert len(col_engine._plans) <= E.PLANS_KEPT


def _plain_arena(hs: "list[SegmentHeader]", rng: random.Random) -> "tuple[np.ndarray, list, np.ndarray]":
    """Segments of headers ``hs`` (zero payloads: only the GPU reads them) in an arena as a save leaves them:
    512-byte slots one after another, with a gap now and then (a run of the upload's copies ends there)."""
    blobs = [pack_header(h) + bytes(h.stored_length) for h in hs]
    offs, pos = [], rng.randrange(0, 8) * 512
    for b in blobs:
        offs.append(pos)
        pos = -(-(pos + len(b)) // 512) * 512 + (rng.randrange(1, 4) * 4096 if rng.random() < 0.2 else 0)
    arena = np.zeros(pos, np.uint8)
    for o, b in zip(offs, blobs):
        arena[o:o + len(b)] = np.frombuffer(b, np.uint8)
    return arena, [memoryview(arena)[o:o + len(b)] for o, b in zip(offs, blobs)], np.asarray(offs, dtype=np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_planned_decode_flights_send_what_the_item_path_sends(seed, monkeypatch):
    """decode_columns_submit of segments without ANS (exact, FP8, TurboQuant of both widths) keeps each flight's
    plan (``_DecPlan``) by the headers but for their CRCs and reuses it: the first batch, a second of other
    payloads (other payload CRCs) at other addresses (no new plan) and a third of the first's headers in another
    order (new plans) each upload the same descriptors, copy the same payload runs and launch the same kernels
    as the per-segment decode_submit, and answer the same verdicts for the same accumulators (a CRC mismatch
    where the GPU's does not match). Plans are read-only; an engine keeps PLANS_KEPT of them."""
    metas: list = []

    def pinned(n: int) -> np.ndarray:  # each flight's meta download, to answer as the GPU would
        a = np.zeros(max(n, 1), np.uint8)
        metas.append(a)
        return a

    monkeypatch.setattr(E, "_pinned_array", pinned)
    rng = random.Random(seed)
    msgspec = pytest.importorskip("msgspec")
    first = [msgspec.structs.replace(_header(rng, rng.choice(["raw", "fp8", "tq"]), 48), layer=i) for i in range(36)]
    other = [msgspec.structs.replace(h, payload_crc=rng.getrandbits(32)) for h in first]
    order = list(range(len(first)))
    rng.shuffle(order)
    cols = _recording_engine()
    cols.budget_bytes = 2 << 20  # flights of 1 MiB: several a batch

    def place(hs):
        arena, views, offs = _plain_arena(hs, rng)
        orig = np.array([h.original_length for h in hs], dtype=np.int64)
        return hs, arena, views, offs, orig, (1 << 42) + rng.randrange(1, 1 << 16) * 4096 + np.cumsum(orig) - orig

    def run(eng, placed, columns: bool):
        hs, arena, views, offs, orig, dst = placed
        metas.clear()
        eng.restore.log.clear()
        if columns:
            heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs.tolist()])
            job = eng.decode_columns_submit(heads, arena.ctypes.data + offs + HEADER_SIZE, dst, orig, within=arena)
        else:
            job = eng.decode_submit(views, [E.DeviceSpan(int(d), int(n), (int(n),)) for d, n in zip(dst, orig)],
                                    pinned=[True] * len(hs))
        log = list(eng.restore.log)
        # the GPU's answer: each accumulator the payload CRC's, but for a mismatch on every fifth segment
        expect = np.array([h.payload_crc ^ int(zero_crc(h.stored_length)) for h in hs], dtype=np.int64)
        expect[::5] ^= 1
        counts = [e[3] for e in log if e[0] == "launch" and e[1] == "okv_crc32c"]
        assert len(counts) == len(job.flights) == len(metas) > 1
        r0 = 0
        for f, meta, k in zip(job.flights, metas, counts):
            meta[:16 * k].view(km.META_DTYPE)["acc"] = expect[r0:r0 + k]
            r0 += k
            f.finish()
        return log, [(type(r).__name__, str(r)) if r is not None else None for r in job.results]

    for hs, new in ((first, True), (other, False), ([first[j] for j in order], True)):
        kept = {id(p) for _, plans in cols._dec_plans.values() for p in plans}
        placed = place(hs)
        got = run(cols, placed, True)
        want = run(_recording_engine_of(2 << 20), placed, False)
        assert got == want
        assert [r is not None for r in got[1]] == [i % 5 == 0 for i in range(len(hs))]
        plans = [p for _, ps in cols._dec_plans.values() for p in ps]
        assert all(p is not None for p in plans)
        assert ({id(p) for p in plans} != kept) == new
    plan = plans[0]
    with pytest.raises(ValueError):
        plan.rows[0, 0] = 1
    for _ in range(E.PLANS_KEPT + 8):  # header orders never seen again: the engine keeps PLANS_KEPT at most
        rng.shuffle(order)
        run(cols, place([first[j] for j in order]), True)
        assert len(cols._dec_plans) <= E.PLANS_KEPT


def _recording_engine_of(budget: int) -> "E.GpuCodecEngine":
    eng = _recording_engine()
    eng.budget_bytes = budget
    return eng


@pytest.mark.parametrize("seed", range(4))
def test_header_consts_keep_every_array_they_answer_held(seed, monkeypatch):
    """``_header_consts`` answers raw device addresses that a flight's ``okv_write_headers`` reads later, so the
    arrays behind all three must stay held by the memo after the call, also when the memo is full and the plan and
    the class set both miss. Device arrays are faked (``cp.asarray``): each records whether it is still alive.
    An earlier version dropped the plan's rows when inserting the class set's constants cleared the memo."""
    alive: dict[int, weakref.ref] = {}

    class _DevArray:
        def __init__(self, a: np.ndarray) -> None:
            self.data = types.SimpleNamespace(ptr=len(alive) + 1)
            alive[self.data.ptr] = weakref.ref(self)

    monkeypatch.setattr(E, "cp", types.SimpleNamespace(asarray=_DevArray))
    monkeypatch.setattr(E, "_header_rows", lambda c, plan: np.zeros(4, np.uint32))
    eng = _bare_engine(1 << 20)
    eng._dev_headers, eng.save = {}, types.SimpleNamespace(stream=contextlib.nullcontext())
    rng = random.Random(seed)
    sets = [types.SimpleNamespace(templates=np.zeros((2, 64), np.uint8), bases=np.zeros(2, np.int64)) for _ in range(5)]
    plans = []
    for _ in range(6 * E.PLANS_KEPT):
        # a plan seen before, or a new one; a class set of a few, or a new one: every mix of hits and misses
        plan = rng.choice(plans) if plans and rng.random() < 0.3 else object()
        plans = (plans + [plan])[-8:]
        cs = rng.choice(sets) if rng.random() < 0.6 else types.SimpleNamespace(templates=np.zeros((1, 64), np.uint8),
                                                                              bases=np.zeros(1, np.int64))
        ptrs = eng._header_consts(cs, np.zeros(1, np.int32), plan)
        gc.collect(0)  # the young objects: a full collection per step took minutes in a full suite run
        assert all(alive[p]() is not None for p in ptrs), (len(eng._dev_headers), ptrs)
        assert len(eng._dev_headers) <= E.PLANS_KEPT


def test_a_flights_event_is_recorded_again_only_once_its_flight_is_done(monkeypatch):
    """``Worker.launched`` records each flight's end on a CUDA event that ``finish`` waits on; events of flights
    finished (or dropped after the streams were drained) are recorded again by later flights instead of a new
    event per flight. No event may serve two flights in flight at once: the older one's wait would then end
    at the newer one's end, or its host part run early. CUDA is faked: each event records its flight."""
    made: list = []

    class _Event:
        def __init__(self, disable_timing: bool = False) -> None:
            made.append(self)

        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(E.cp.cuda, "Event", _Event)
    w = object.__new__(E.Worker)
    stream = types.SimpleNamespace(synchronize=lambda: None)
    w.stream = w.copies = stream
    w.ws = types.SimpleNamespace(ptr=0)
    w.uploads = (object(), object())
    w.inflight, w._spare_events = [], []
    w.stats = collections.Counter()
    rng = random.Random(5)
    done: list = []
    for step in range(400):
        if len(w.inflight) < 2 and rng.random() < 0.6:
            f = w.launched(0, 1, w.uploads[step % 2], lambda: done.append(step))
            assert all(g.event is not f.event for g in w.inflight if g is not f)  # never shared in flight
        elif w.inflight and rng.random() < 0.8:
            w.finish(w.inflight[0])
        elif w.inflight:
            w.drop(list(w.inflight))
    assert len(made) == 2 and done  # two flights in flight at most: two events in all
