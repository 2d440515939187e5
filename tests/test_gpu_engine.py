"""GpuCodecEngine against the host codecs: segment bytes equal encode_segment's, decoded values equal
decode_segment's (TurboQuant on random and real K/V, FP8, raw, ANS), batches of 1/255/256/257 mixed
segments, a budget too small for the batch, poisoned outputs, per-segment decode failures. Needs a GPU."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from orbitkv_fs.codecs import decode_segment, encode_segment  # noqa: E402
from orbitkv_fs.codecs.turboquant import TurboQuantCodec  # noqa: E402
from orbitkv_fs.errors import LengthMismatch, OrbitKVError, PayloadChecksumMismatch, SegmentError  # noqa: E402
from orbitkv_fs.gpu.engine import MAX_BATCH, EncodeItem, GpuCodecEngine  # noqa: E402
from orbitkv_fs.segment import Format, RawReason, parse_header, parse_segment  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
SEED = 9


@pytest.fixture(scope="module")
def engine():
    e = GpuCodecEngine(64 << 20, seed=SEED)
    yield e
    e.close()


def real_kv() -> "tuple[np.ndarray, np.ndarray]":
    """SmolLM2 K and V ([layers, tokens, heads, 64] BF16) from ORBITKV_REAL_KV, else a CPU prefill."""
    path = os.environ.get("ORBITKV_REAL_KV")
    if path and os.path.isfile(path):
        z = np.load(path)
        return z["k"].view(BF16), z["v"].view(BF16)
    try:
        from orbitkv_fs.tools.models import ModelUnavailable, prefill_kv
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"no real K/V: {e}")
    try:
        kv = prefill_kv(max_tokens=64)
    except ModelUnavailable as e:
        pytest.skip(f"no real K/V: {e}")
    return np.stack([k for k, _ in kv]), np.stack([v for _, v in kv])


def dev(x: np.ndarray) -> "cp.ndarray":
    """A device copy of ``x`` (16-bit dtypes travel as uint16: cupy has no bfloat16)."""
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize in (1, 2):
        x = x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint16)
    return cp.asarray(x)


def host_segment(x: np.ndarray, codec: str, role: str, layer: int) -> bytes:
    c = TurboQuantCodec(int(codec[-1]), SEED) if codec.startswith("turboquant") else codec
    return encode_segment(x, c, role=role, layer=layer)


def check_round_trip(engine: GpuCodecEngine, xs: list[np.ndarray], codecs: list[str], roles: list[str],
                     layers: list[int], *, exact_bytes: bool = True) -> list[bytes]:
    items = [EncodeItem(dev(x), c, r, ly, x.dtype) for x, c, r, ly in zip(xs, codecs, roles, layers)]
    segs = engine.encode_batch(items)
    assert len(segs) == len(xs)
    for x, c, r, ly, s in zip(xs, codecs, roles, layers, segs):
        want = host_segment(x, c, r, ly)
        if exact_bytes or c != "ans":
            assert bytes(s) == want, (c, r, ly, x.shape, x.dtype)
        else:
            assert np.array_equal(decode_segment(s).view(np.uint8), np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    dsts = [cp.full(x.nbytes // 2 if x.dtype.itemsize == 2 else x.nbytes, 0xA5A5 if x.dtype.itemsize == 2 else 0xA5,
                    dtype=np.uint16 if x.dtype.itemsize == 2 else np.uint8) for x in xs]
    errors = engine.decode_batch(segs, dsts)
    assert errors == [None] * len(xs)
    for s, d in zip(segs, dsts):
        want = decode_segment(bytes(s))
        assert np.array_equal(d.get().view(np.uint8), want.view(np.uint8))
    return [bytes(s) for s in segs]


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_turboquant_random_equals_host(engine, head_dim: int, dtype: np.dtype) -> None:
    rng = np.random.default_rng(head_dim)
    xs, codecs, roles, layers = [], [], [], []
    for bits in (3, 4):
        for role in ("key", "value"):
            for scale in (0.01, 1.0, 30.0):
                x = (rng.standard_normal((97, head_dim)) * scale).astype(np.float32)
                x[3] = 0.0  # a zero vector: norm 0, scale 0
                x[5] = 1.0  # a constant vector
                xs.append(x.astype(dtype))
                codecs.append(f"turboquant-{bits}")
                roles.append(role)
                layers.append(int(rng.integers(0, 40)))
    segs = check_round_trip(engine, xs, codecs, roles, layers)
    assert all(parse_segment(s)[0].format == Format.TURBOQUANT for s in segs)


def test_golden_segments_equal_the_pinned_digests() -> None:
    """The GPU writes the format's test vectors (tests/golden_segments.py) byte for byte, the same digests
    the host gives under every CPU dispatch level (tests/test_bytes_every_cpu.py)."""
    import hashlib

    import golden_segments as g

    e = GpuCodecEngine(64 << 20, seed=0)
    try:
        tq_keys = [(d, bits, role) for d in g.HEAD_DIMS for bits in (3, 4) for role in ("key", "value")]
        fp8_keys = [(d, t) for d in (64, 128) for t in (g.BF16, g.FP16)]
        items = [EncodeItem(dev(g.golden_input(d)), f"turboquant-{bits}", role, 3, g.BF16) for d, bits, role in tq_keys]
        items += [EncodeItem(dev(g.golden_input(d, t)), "fp8", "key", 3, t) for d, t in fp8_keys]
        segs = [hashlib.sha256(bytes(s)).hexdigest()[:16] for s in e.encode_batch(items)]
    finally:
        e.close()
    assert dict(zip([f"{d}/{b}/{r}" for d, b, r in tq_keys], segs)) == g.TURBOQUANT
    assert dict(zip([f"{d}/{np.dtype(t).name}" for d, t in fp8_keys], segs[len(tq_keys):])) == g.FP8


def test_turboquant_extreme_magnitudes_equal_host(engine) -> None:
    """Inputs on both sides of the kernels' fast-division range (BF16 magnitudes in [2^-60, 2^30)): tiny
    vectors, tiny elements beside normal ones, exact zeros, FP16 subnormals; both paths give the host's bytes."""
    rng = np.random.default_rng(7)
    xs, codecs, roles = [], [], []
    for head_dim in (64, 128):
        base = rng.standard_normal((64, head_dim)).astype(np.float32)
        mixed = base.copy()
        mixed[::3, 5] = 1e-30  # below 2^-60 beside normal elements
        mixed[1::3, :7] = 0.0
        sparse = np.zeros_like(base)
        sparse[:, 3] = base[:, 3]  # one nonzero element per vector
        for x, dt in ((base * 1e-25, BF16), (mixed, BF16), (base * 2.0 ** 29, BF16), (sparse, BF16),
                      (base * 6e-8, FP16), (mixed, FP16)):
            for bits in (3, 4):
                for role in ("key", "value"):
                    xs.append(x.astype(dt))
                    codecs.append(f"turboquant-{bits}")
                    roles.append(role)
    check_round_trip(engine, xs, codecs, roles, [5] * len(xs))


def test_turboquant_subnormal_squares_equal_host(engine) -> None:
    """Keys whose float32 squares are subnormal: the host keeps IEEE gradual underflow; the GPU must too
    (CuPy's RawModule builds with -ftz=true, cupy#9576: module.build_module does not)."""
    rng = np.random.default_rng(11)
    xs = [(rng.standard_normal((64, 128)) * 2.0 ** e).astype(np.float32).astype(BF16) for e in (-70, -66, -64)]
    check_round_trip(engine, xs, ["turboquant-4"] * 3, ["key"] * 3, [5] * 3)


def test_turboquant_real_kv_equals_host(engine) -> None:
    k, v = real_kv()
    xs, codecs, roles, layers = [], [], [], []
    for layer in range(0, k.shape[0], 3):
        for bits in (3, 4):
            xs += [k[layer].reshape(-1, 64), v[layer].reshape(-1, 64)]
            codecs += [f"turboquant-{bits}"] * 2
            roles += ["key", "value"]
            layers += [layer, layer]
    check_round_trip(engine, xs, codecs, roles, layers)


def test_turboquant_rejections_equal_host(engine) -> None:
    x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    nan = x.copy()
    nan[7, 3] = np.nan
    big = x.copy()
    big[2, 0] = -1e6  # V: the FP16 minimum overflows
    xs = [nan.astype(FP16), big.astype(BF16), big.astype(FP16), (x * 1e30).astype(BF16)]
    segs = check_round_trip(engine, xs, ["turboquant-4", "turboquant-4", "turboquant-3", "turboquant-4"],
                            ["key", "value", "value", "key"], [1, 2, 3, 4])
    reasons = [parse_segment(s)[0].raw_reason for s in segs]
    assert reasons[0] == RawReason.NONFINITE and RawReason.OUT_OF_RANGE in reasons


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arith", [False, True], ids=["hw", "arith"])
def test_fp8_segments_equal_host(dtype: np.dtype, arith: bool) -> None:
    from orbitkv_fs.codecs.fp8 import _ENC

    good = np.flatnonzero((_ENC[dtype] >> 8) == 0).astype(np.uint16)
    rng = np.random.default_rng(3)
    xs = [good.view(dtype)]  # every in-range pattern
    xs += [rng.choice(good, n).view(dtype) for n in (300, 4096, 100_000, 8 << 20)]
    bad = rng.choice(good, 5000).view(dtype).copy()
    bad[17] = 449.0 if dtype == FP16 else 460.0
    inf = rng.choice(good, 5000).view(dtype).copy()
    inf[4000] = np.inf
    xs += [bad, inf, np.zeros(3, dtype)]
    with GpuCodecEngine(64 << 20, seed=SEED, fp8_arithmetic=arith) as e:
        segs = check_round_trip(e, xs, ["fp8"] * len(xs), ["value"] * len(xs), list(range(len(xs))))
    reasons = [parse_segment(s)[0].raw_reason for s in segs[-3:]]
    assert reasons == [RawReason.OUT_OF_RANGE, RawReason.NONFINITE, RawReason.NOT_SMALLER]


def test_ans_round_trips_and_ratio(engine) -> None:
    k, v = real_kv()
    kv = np.concatenate([k.reshape(-1), v.reshape(-1)])
    blobs = [kv[: 48 << 10], kv[: 1 << 20], kv[: 8 << 20]]  # up to the 16 MiB source bound
    ratios = []
    for x in blobs:
        s = encode_segment(x, "ans")
        h, _ = parse_segment(s)
        assert h.format == Format.ANS and h.ans_type == 2
        ratios.append(x.nbytes / h.stored_length)
        assert np.array_equal(decode_segment(s).view(np.uint16), x.view(np.uint16))
    print(f"ANS ratio on real BF16 KV (96 KiB, 2 MiB, 16 MiB): {[round(r, 3) for r in ratios]}")
    assert ratios[-1] > 1.25
    fp8 = kv.astype(np.float32).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = encode_segment(fp8, "ans")
    assert parse_segment(s)[0].ans_type == 3
    assert np.array_equal(decode_segment(s).view(np.uint8), fp8.view(np.uint8))
    rand = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    s = encode_segment(rand, "ans")
    assert parse_segment(s)[0].raw_reason == RawReason.NOT_SMALLER  # incompressible: stays raw
    assert np.array_equal(decode_segment(s), rand)
    small = kv[:1000]
    assert parse_segment(encode_segment(small, "ans"))[0].raw_reason == RawReason.UNSUPPORTED
    # the engine's batched ANS: same decoded bytes, same format decisions, either decodes the other's
    xs = [kv[: 1 << 20], rand, small, fp8[: 1 << 16], kv[: 8 << 20], kv[: 65536 + 4]]
    check_round_trip(engine, xs, ["ans"] * len(xs), ["opaque"] * len(xs), [0] * len(xs), exact_bytes=False)
    host = [encode_segment(x, "ans") for x in xs]
    dsts = [cp.zeros(x.nbytes, dtype=np.uint8) for x in xs]
    assert engine.decode_batch(host, dsts) == [None] * len(xs)
    for x, d in zip(xs, dsts):
        assert np.array_equal(d.get(), np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def test_ans_slots_are_packed_and_a_short_download_fetches_its_tail() -> None:
    """ANS payloads lie one after another in the output region (each header and payload rounded up to the
    slot alignment; one stored raw takes no room there), so the download moves the packed bytes, cut at the
    previous batch's packed share: a batch that packs worse than that fetches its tail, and every segment
    decodes to its source either way."""
    from orbitkv_fs.gpu.engine import SLOT_ALIGN
    from orbitkv_fs.hostmem import host_address

    rng = np.random.default_rng(21)

    def smooth(n: int) -> np.ndarray:  # BF16, nearly all zeros: packs to a small share of the worst case
        x = np.zeros(n // 2, dtype=np.float32)
        x[::997] = 1.0
        return x.astype(BF16)

    def normal(n: int) -> np.ndarray:  # BF16 normals: exponents compress, mantissas do not
        return rng.standard_normal(n // 2).astype(BF16)

    def check_packed(segs: list, xs: list) -> None:
        ans = [(host_address(s), len(s)) for s in segs if parse_header(bytes(s[:64])).format == Format.ANS]
        assert len(ans) >= 2
        for (a, n), (b, _) in zip(ans, ans[1:]):
            assert b - a == -(-n // SLOT_ALIGN) * SLOT_ALIGN  # the next ANS slot right after this one

    rand = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # incompressible: raw, no room in the packed slots
    xs = [normal(1 << 20), rand, normal(3 << 18), normal(1 << 20), smooth(1 << 19), normal(5 << 16)]
    items = [EncodeItem(dev(x), "ans", "opaque", 0, x.dtype) for x in xs]
    with GpuCodecEngine(256 << 20, seed=SEED) as e:
        for short in (False, False, True):  # the first batch downloads its worst case, the second its guess
            if short:
                e._ans_packed = 0.0  # as after a batch that packed to nothing: this download is short
            segs = e.encode_batch(items)
            assert e.stats.get("save_ans_tail_fetches", 0) == int(short)
            assert 0.0 < e._ans_packed < 1.0
            assert parse_segment(bytes(segs[1]))[0].raw_reason == RawReason.NOT_SMALLER
            check_packed(segs, xs)
            for x, s in zip(xs, segs):
                assert np.array_equal(decode_segment(bytes(s)).view(np.uint8), x.reshape(-1).view(np.uint8))
        check_round_trip(e, xs, ["ans"] * len(xs), ["opaque"] * len(xs), [0] * len(xs), exact_bytes=False)
        # The column path, whose ANS headers okv_write_headers writes at the slots okv_ans_pack leaves: packed the
        # same, a short download's tail (headers and payloads) fetched, every segment as the item path's.
        classes = [e.encode_class(it) for it in items]
        ptrs = np.array([it.array.data.ptr for it in items], dtype=np.int64)
        for short in (False, True):
            if short:
                e._ans_packed = 0.0
            fetched = e.stats.get("save_ans_tail_fetches", 0)
            job = e.encode_columns_submit(classes, np.arange(len(items)), ptrs)
            assert job is not None
            segs = e.encode_collect(job)
            assert e.stats.get("save_ans_tail_fetches", 0) - fetched == int(short)
            assert parse_segment(bytes(segs[1]))[0].raw_reason == RawReason.NOT_SMALLER
            check_packed(segs, xs)
            for x, s in zip(xs, segs):
                assert np.array_equal(decode_segment(bytes(s)).view(np.uint8), x.reshape(-1).view(np.uint8))


def test_ans_rounds_in_a_small_workspace_round_trip() -> None:
    """A workspace that holds only a few ANS chunks' worst-case nvCOMP buffers: each encode batch compresses its
    ANS segments in rounds that reuse one set of buffers, its payloads still packed one after another. Through
    the item path and the column path, every segment decodes to its source and takes the format a workspace of
    one round per batch gives it (an incompressible one raw, a short one raw, the rest ANS)."""
    from orbitkv_fs.gpu.engine import SLOT_ALIGN, DeviceSpan
    from orbitkv_fs.hostmem import host_address

    rng = np.random.default_rng(33)
    sizes = [64 << 10] * 6 + [256 << 10] * 5 + [1 << 20] * 3 + [48 << 10] * 4
    xs: list[np.ndarray] = [rng.standard_normal(n // 2).astype(BF16) for n in sizes]
    xs[3] = rng.integers(0, 256, 64 << 10, dtype=np.uint8)  # incompressible: raw
    xs[7] = xs[7][:1000]  # under ANS's 4 KiB minimum: raw
    order = rng.permutation(len(xs))
    xs = [xs[i] for i in order]
    codecs, roles, layers = ["ans"] * len(xs), ["opaque"] * len(xs), list(range(len(xs)))

    def formats(segs) -> list:
        return [(h.format, h.raw_reason) for h in (parse_header(bytes(s[:64])) for s in segs)]

    with GpuCodecEngine(256 << 20, seed=SEED) as big:
        want = formats(check_round_trip(big, xs, codecs, roles, layers, exact_bytes=False))
        assert big.stats["save_ans_rounds"] == big.stats["save_batches"]
    assert sum(f[0] == Format.ANS for f in want) == len(xs) - 2
    with GpuCodecEngine(8 << 20, seed=SEED) as e:
        got = check_round_trip(e, xs, codecs, roles, layers, exact_bytes=False)
        assert formats(got) == want
        st = e.stats
        assert st["save_ans_rounds"] > st["save_batches"] > 1 and st["save_workspace_bytes"] <= 8 << 20
        # the column path: sources in one device buffer, a class per distinct shape
        flat = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in xs]
        buf = cp.asarray(np.concatenate(flat))
        offs = np.cumsum([0] + [f.nbytes for f in flat])[:-1]
        keys: dict = {}
        classes, cls = [], []
        for x, f, o, ly in zip(xs, flat, offs.tolist(), layers):
            key = (x.dtype.str, x.shape)
            if key not in keys:
                keys[key] = len(classes)
                classes.append(e.encode_class(EncodeItem(DeviceSpan(buf.data.ptr + o, f.nbytes, x.shape), "ans",
                                                         "opaque", 0, x.dtype)))
            cls.append(keys[key])
        job = e.encode_columns_submit(classes, np.array(cls), buf.data.ptr + offs)
        assert job is not None
        segs = e.encode_collect(job)
        rounds = e.stats["save_ans_rounds"] - st["save_ans_rounds"]
        assert rounds > e.stats["save_batches"] - st["save_batches"] > 1
        assert [(f, r) for f, r in formats(segs)] == want
        for x, s in zip(xs, segs):
            assert np.array_equal(decode_segment(bytes(s)).view(np.uint8), np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        ans = sorted((host_address(s), len(s)) for s in segs if parse_header(bytes(s[:64])).format == Format.ANS)
        packed = sum(b - a == -(-n // SLOT_ALIGN) * SLOT_ALIGN for (a, n), (b, _) in zip(ans, ans[1:]))
        assert packed >= len(ans) - (e.stats["save_batches"] - st["save_batches"])  # packed within each batch


@pytest.mark.parametrize("in_place", [False, True])
def test_ans_decode_as_arrays_from_one_host_array(in_place: bool) -> None:
    """decode_columns_submit of ANS segments lying in one host array (as the Manager's arena holds them): each
    decodes to its source; a damaged chunk table is that segment's LengthMismatch (its destination untouched),
    a damaged bitstream (CRC recomputed) its error or other bytes, a flipped payload byte its checksum error;
    the others decode all the same. ``in_place`` (nvCOMP writes the destinations, the Manager's temporary): a
    failed segment may leave its own destination written, never a byte outside the destinations; without it
    a checksum failure leaves its destination untouched."""
    from orbitkv_fs.segment import HEADER_SIZE, build_segment

    rng = np.random.default_rng(33)
    xs = [rng.standard_normal(n // 2).astype(BF16)
          for n in (3 << 16, 1 << 20, 5 << 16, 3 << 16, (1 << 19) + 4096, 3 << 16)]
    with GpuCodecEngine(256 << 20, seed=SEED) as e:
        segs = [bytes(s) for s in e.encode_batch([EncodeItem(dev(x), "ans", "opaque", 0, x.dtype) for x in xs])]
        assert all(parse_header(s).format == Format.ANS for s in segs)
        h2, p2 = parse_segment(segs[2])
        bad_table = bytearray(p2)
        bad_table[4] += 1  # one chunk more than the length needs
        segs[2] = build_segment(h2, bytes(bad_table))
        h3, p3 = parse_segment(segs[3])
        bad_stream = bytearray(p3)
        bad_stream[40:400] = bytes(360)
        segs[3] = build_segment(h3, bytes(bad_stream))
        flipped = bytearray(segs[5])
        flipped[HEADER_SIZE + 500] ^= 0x40  # a bitstream byte; the header's CRC32C no longer matches
        segs[5] = bytes(flipped)
        arena = np.zeros(sum(len(s) + 512 for s in segs), np.uint8)
        offs, pos = [], 0
        for s in segs:
            arena[pos:pos + len(s)] = np.frombuffer(s, np.uint8)
            offs.append(pos)
            pos = -(-(pos + len(s)) // 512) * 512
        heads = np.stack([arena[o:o + HEADER_SIZE] for o in offs])
        gap = 4096  # guard bytes around every destination, in one allocation
        at = np.cumsum([0] + [x.nbytes + gap for x in xs]) + gap
        whole = cp.full(int(at[-1]), 0xA5, dtype=np.uint8)
        dsts = [whole[a:a + x.nbytes] for a, x in zip(at.tolist(), xs)]
        job = e.decode_columns_submit(heads, arena.ctypes.data + np.array(offs) + HEADER_SIZE,
                                      np.array([int(d.data.ptr) for d in dsts]), np.array([x.nbytes for x in xs]),
                                      within=arena, in_place=in_place)
        assert job is not None
        errs = e.decode_collect(job)
        for j in (0, 1, 4):
            assert errs[j] is None and np.array_equal(dsts[j].get(), xs[j].view(np.uint8)), j
        assert isinstance(errs[2], LengthMismatch) and bool((dsts[2] == 0xA5).all())  # never sent
        if errs[3] is None:  # nvCOMP may decode garbage without complaint; then the bytes differ
            assert not np.array_equal(dsts[3].get(), xs[3].view(np.uint8))
        else:
            assert isinstance(errs[3], SegmentError)
        assert isinstance(errs[5], PayloadChecksumMismatch)
        assert in_place or bool((dsts[5] == 0xA5).all())
        guards = np.ones(int(at[-1]), dtype=bool)
        for a, x in zip(at.tolist(), xs):
            guards[a:a + x.nbytes] = False
        assert bool((whole.get()[guards] == 0xA5).all())  # nothing outside the destinations


def test_ans_damaged_chunks_are_per_segment_errors(engine) -> None:
    k, _ = real_kv()
    x = k.reshape(-1)[: 3 * 65536]
    good = encode_segment(x, "ans")
    h, payload = parse_segment(good)
    from orbitkv_fs.segment import build_segment

    bad_stream = bytearray(payload)
    bad_stream[40:200] = bytes(160)  # zero part of chunk 0's bitstream; the CRC is recomputed to match
    bad_table = bytearray(payload)
    bad_table[8] ^= 0x10  # chunk 0's size no longer adds up
    segs = [good, build_segment(h, bytes(bad_stream)), build_segment(h, bytes(bad_table))]
    dsts = [cp.full(x.nbytes, 0xA5, dtype=np.uint8) for _ in segs]
    errors = engine.decode_batch(segs, dsts)
    assert errors[0] is None and isinstance(errors[2], LengthMismatch)
    assert np.array_equal(dsts[0].get(), x.view(np.uint8))
    if errors[1] is None:  # nvCOMP may decode garbage without complaint; then the bytes differ
        assert not np.array_equal(dsts[1].get(), x.view(np.uint8))
    else:
        assert isinstance(errors[1], SegmentError) and bool((dsts[1] == 0xA5).all())
    assert bool((dsts[2] == 0xA5).all())


def mixed(n: int, rng: np.random.Generator) -> tuple[list, list, list, list]:
    xs, codecs, roles, layers = [], [], [], []
    choices = ["fp8", "turboquant-4", "turboquant-3", "none", "ans"]
    for i in range(n):
        c = choices[i % len(choices)]
        d = [32, 64, 128, 256][i % 4]
        rows = int(rng.integers(40, 300))  # large enough for the GPU path of every codec
        x = (rng.standard_normal((rows, d)) * rng.uniform(0.1, 5)).astype(BF16 if i % 2 else FP16)
        xs.append(x)
        codecs.append(c)
        roles.append(["key", "value"][i % 2] if c.startswith("turbo") else "opaque")
        layers.append(i % 50)
    return xs, codecs, roles, layers


@pytest.mark.parametrize("less", [None, 1, 0, -1])
def test_batches_of_mixed_segments(less: int | None) -> None:
    """One segment, and MAX_BATCH less ``less``: one descriptor batch up to MAX_BATCH segments, two past it
    (a workspace that holds them all: only the count closes a batch)."""
    n = 1 if less is None else MAX_BATCH - less
    with GpuCodecEngine(1 << 30, seed=SEED) as e:
        xs, codecs, roles, layers = mixed(n, np.random.default_rng(n))
        check_round_trip(e, xs, codecs, roles, layers, exact_bytes=False)
        assert e.stats["save_batches"] == (2 if n > MAX_BATCH else 1)


def test_poisoned_workspace_every_byte_written() -> None:
    with GpuCodecEngine(8 << 20, seed=SEED) as e:
        for w in (e.save, e.restore):
            w.ws.reserve(e.budget_bytes)
            cp.cuda.runtime.memset(w.ws.ptr, 0xA5, w.ws.size)
        xs, codecs, roles, layers = mixed(40, np.random.default_rng(40))
        check_round_trip(e, xs, codecs, roles, layers, exact_bytes=False)
        assert e.stats["save_workspace_grows"] == 1  # reserved once, reused


def test_budget_too_small_for_the_batch() -> None:
    rng = np.random.default_rng(8)
    xs = [(rng.standard_normal((1024, 128))).astype(BF16) for _ in range(12)]  # 256 KiB each
    xs.append(rng.standard_normal((8192, 128)).astype(BF16))  # 2 MiB: over the 1 MiB budget alone
    codecs = ["fp8", "turboquant-4", "none"] * 4 + ["fp8"]
    roles = ["value", "key", "opaque"] * 4 + ["value"]
    with GpuCodecEngine(1 << 20, seed=SEED) as e:
        check_round_trip(e, xs, codecs, roles, list(range(13)))
        st = e.stats
        assert st["save_cpu_fallbacks"] == 1 and st["save_batches"] > 1
        assert st["save_workspace_bytes"] <= 1 << 20 and st["restore_workspace_bytes"] <= 1 << 20


def test_decode_failures_are_per_segment(engine) -> None:
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal((256, 64)).astype(BF16) for _ in range(4)]
    segs = [bytearray(s) for s in engine.encode_batch(
        [EncodeItem(dev(x), c, "key", 3, BF16) for x, c in zip(xs, ["fp8", "turboquant-4", "none", "fp8"])])]
    segs[0][100] ^= 0x01  # payload bit flip
    segs[2][10] ^= 0xFF  # header damage
    dsts = [cp.full(x.nbytes // 2, 0xA5A5, dtype=np.uint16) for x in xs]
    dsts[3] = cp.full(10, 0xA5A5, dtype=np.uint16)  # wrong destination size
    errors = engine.decode_batch(segs, dsts)
    assert isinstance(errors[0], PayloadChecksumMismatch)
    assert errors[1] is None
    assert isinstance(errors[2], SegmentError)
    assert isinstance(errors[3], LengthMismatch)
    assert bool((dsts[0] == 0xA5A5).all()) and bool((dsts[3] == 0xA5A5).all())
    assert np.array_equal(dsts[1].get().view(np.uint8), decode_segment(bytes(segs[1])).view(np.uint8))
    assert all(isinstance(e, OrbitKVError) for e in errors if e is not None)


def test_one_batch_is_one_sync_and_one_copy_each_way(engine) -> None:
    rng = np.random.default_rng(2)
    items = [EncodeItem(dev(rng.standard_normal((64, 128)).astype(BF16)), "fp8", "value", 1, BF16) for _ in range(256)]
    engine.encode_batch(items)
    before = engine.stats
    engine.encode_batch(items)
    after = engine.stats
    delta = {k: after[k] - before.get(k, 0) for k in ("save_syncs", "save_d2h_copies", "save_h2d_copies", "save_launches")}
    assert delta == {"save_syncs": 1, "save_d2h_copies": 1, "save_h2d_copies": 1, "save_launches": 1}


@pytest.mark.parametrize("head_dim", [64, 6], ids=["16-byte rows", "byte rows"])
def test_gather_and_scatter_blocks_of_packed_pages(engine, head_dim):
    """The block-copy kernel moves the K half of vLLM packed blocks ([block, head, token, 2 x head_dim]) to
    a contiguous buffer and back, exactly, touching no other block and not the V half."""
    from orbitkv_fs.manager.device import _block_table, _rows_of

    class Seg:  # the two fields _block_table reads of a Manager segment
        pass

    rng = np.random.default_rng(5)
    pages = cp.asarray(rng.integers(0, 1 << 16, (8, 3, 4, 2 * head_dim), dtype=np.uint16))
    base = pages[:, :, :, :head_dim]
    seg = Seg()
    seg.block_bytes = 3 * 4 * head_dim * 2
    seg.copy = (int(base.data.ptr), base.strides[0]) + _rows_of(base.shape[1:], base.strides[1:], 2)
    blocks = [5, 1, 6]
    buf = engine.block_buffer(3 * seg.block_bytes, restore=False)
    engine.gather_blocks(_block_table([(seg, blocks, int(buf.data.ptr))], gather=True))
    engine.save.sync()
    want = cp.ascontiguousarray(base[cp.asarray(blocks)])
    assert cp.array_equal(buf.view(cp.uint16).reshape(want.shape), want)
    before = pages.copy()
    new = cp.asarray(rng.integers(0, 1 << 16, want.shape, dtype=np.uint16))
    out = engine.block_buffer(3 * seg.block_bytes, restore=True)
    out.view(cp.uint16)[:] = new.reshape(-1)
    # The scatter follows this (current) stream's write of its source; its event says when it has run.
    engine.scatter_blocks(_block_table([(seg, blocks, int(out.data.ptr))], gather=False)).synchronize()
    expect = before.copy()
    expect[cp.asarray(blocks), :, :, :head_dim] = new
    assert cp.array_equal(pages, expect)


def test_submitted_batches_overlap_and_collect_in_any_order() -> None:
    """Two encode (then decode) submissions in flight on one worker at once, collected newest first: the
    segments equal the host codec's and the decoded values the host decoder's."""
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((64, 8, 128), dtype=np.float32).astype(BF16) for _ in range(8)]
    codecs = ["fp8", "none", "turboquant-4", "fp8"] * 2
    with GpuCodecEngine(1 << 20, seed=SEED) as e:
        items = [EncodeItem(dev(x), c, "key", 4, BF16) for x, c in zip(xs, codecs)]
        first, second = e.encode_submit(items[:4]), e.encode_submit(items[4:])
        assert len(e.save.inflight) == 2  # side by side in the workspace, from the two upload buffers
        a, b = first.flights[-1], second.flights[-1]
        assert (a.end <= b.start or b.end <= a.start) and a.upload != b.upload
        segs = e.encode_collect(second)
        segs = e.encode_collect(first) + segs
        assert [bytes(s) for s in segs] == [host_segment(x, c, "key", 4) for x, c in zip(xs, codecs)]
        dsts = [cp.full(x.size, 0xA5A5, dtype=cp.uint16) for x in xs]
        d1, d2 = e.decode_submit(segs[:4], dsts[:4]), e.decode_submit(segs[4:], dsts[4:])
        assert e.decode_collect(d2) == [None] * 4
        assert e.decode_collect(d1) == [None] * 4
        for s, d in zip(segs, dsts):
            assert np.array_equal(d.get(), decode_segment(s).view(np.uint16).reshape(-1))


@pytest.mark.parametrize("seed", range(3))
def test_column_flights_headers_written_on_the_gpu_equal_the_host_codecs(engine, seed) -> None:
    """encode_columns_submit of flights without ANS (exact, FP8, TurboQuant K and V, a value out of FP8's range
    that falls back to raw, both 16-bit types): okv_write_headers writes every header on the GPU, and each
    segment, header and payload, equals encode_segment's bytes; each header's payload and header CRCs verify."""
    from orbitkv_fs.gpu.engine import DeviceSpan

    rng = np.random.default_rng(100 + seed)
    kinds = [("none", BF16, "key"), ("fp8", BF16, "value"), ("turboquant-4", BF16, "key"),
             ("turboquant-4", FP16, "value"), ("fp8", FP16, "key"), ("none", FP16, "value")]
    shapes = [(int(rng.integers(2, 24)), 4, 128) for _ in kinds]
    n = int(rng.integers(40, 300))
    cls = rng.integers(0, len(kinds), n)
    xs = [(rng.standard_normal(shapes[c]) * 0.5).astype(kinds[c][1]) for c in cls]
    fp8 = [i for i, c in enumerate(cls) if kinds[c][0] == "fp8"]
    if fp8:
        xs[fp8[0]].reshape(-1)[0] = 1e4  # beyond FP8's 448: this segment falls back to raw
    flat = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in xs]
    buf = cp.asarray(np.concatenate(flat))
    offs = np.cumsum([0] + [f.nbytes for f in flat])[:-1]
    classes = [engine.encode_class(EncodeItem(DeviceSpan(buf.data.ptr, int(np.prod(s)) * dt.itemsize, s), codec, role,
                                              7 + j, dt)) for j, ((codec, dt, role), s) in enumerate(zip(kinds, shapes))]
    launches = engine.save.stats["launches"]
    job = engine.encode_columns_submit(classes, cls, buf.data.ptr + offs)
    assert job is not None
    segs = engine.encode_collect(job)
    assert engine.save.stats["launches"] > launches
    for i, (x, c) in enumerate(zip(xs, cls)):
        codec, _, role = kinds[c]
        want = host_segment(x, codec, role, 7 + int(c))
        assert segs[i] is not None  # no out_region: every segment is a view of the engine's own region
        got = bytes(segs[i])
        assert got == want, (i, codec)
        parse_segment(got)  # both CRCs
