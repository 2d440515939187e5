"""GPU kernels against the host references: FP8 (every BF16/FP16 pattern, both conversion paths),
TurboQuant bytes (random and real K/V), CRC32C (lengths 1 B .. 16 MiB, any offset). Needs a GPU."""

from __future__ import annotations

import crc32c
import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from orbitkv_fs.codecs.fp8 import _DEC, _ENC  # noqa: E402
from orbitkv_fs.gpu import module as km  # noqa: E402
from orbitkv_fs.gpu.tables import finish_crc  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)


def launch(kern: km.Kernels, name: str, rows: list[dict], table=None, meta=None) -> np.ndarray:
    """Run kernel ``name`` once over descriptors ``rows``; returns the Meta records."""
    d = np.zeros(len(rows), dtype=km.SEG_DTYPE)
    block = 0
    for i, r in enumerate(rows):
        for key, val in r.items():
            d[i][key] = val
        d[i]["block0"], d[i]["meta"] = block, i
        block += int(d[i]["nblocks"])
    dev = cp.asarray(d.view(np.uint8))
    if meta is None:
        meta = cp.zeros(16 * len(rows), dtype=np.uint8)
    km.launch(kern, name, dev.data.ptr, len(rows), block, meta.data.ptr, cp.cuda.get_current_stream(), table)
    cp.cuda.get_current_stream().synchronize()
    return meta.get().view(km.META_DTYPE)


@pytest.fixture(params=[False, True], ids=["hw", "arith"])
def kern(request) -> km.Kernels:
    return km.kernels(arith=request.param)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fp8_encode_every_pattern(kern: km.Kernels, dtype: np.dtype) -> None:
    pats = np.arange(1 << 16, dtype=np.uint16)
    src = cp.asarray(pats)
    out = cp.full(1 << 16, 0xA5, dtype=np.uint8)
    # one 2-byte segment per pattern: per-element range flags come back as per-segment statuses
    rows = [{"src": src.data.ptr + 2 * i, "dst": out.data.ptr + i, "n": 2, "dtype": int(dtype == FP16), "nblocks": 1}
            for i in range(1 << 16)]
    meta = launch(kern, "okv_fp8_encode", rows, kern.crc_tables)
    table = _ENC[dtype]
    host_flags = (table >> 8).astype(np.uint32)
    want_status = np.where(host_flags & 2, 2, np.where(host_flags & 1, 1, 0))
    assert np.array_equal(meta["status"], want_status)
    ok = want_status == 0
    got = out.get()
    assert np.array_equal(got[ok], (table & 0xFF).astype(np.uint8)[ok])
    # the fused CRC of each 1-byte payload
    want_crc = np.array([crc32c.crc32c(bytes([b])) for b in got[ok][:4096]], dtype=np.uint32)
    assert np.array_equal(finish_crc(meta["acc"][ok][:4096], 1), want_crc)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fp8_encode_vectorised_path_and_crc(kern: km.Kernels, dtype: np.dtype) -> None:
    table = _ENC[dtype]
    good = np.flatnonzero((table >> 8) == 0).astype(np.uint16)
    rng = np.random.default_rng(5)
    lengths = [8, 16, 4096, 16384, 16385 + 7, 3 * 16384 + 1000, 1 << 20]
    srcs = [rng.choice(good, n) for n in lengths]
    flat = np.concatenate(srcs)
    src = cp.asarray(flat)
    out = cp.full(flat.size + 64 * len(lengths), 0xA5, dtype=np.uint8)
    rows, off, outs = [], 0, []
    o = 0
    for n in lengths:
        rows.append({"src": src.data.ptr + 2 * off, "dst": out.data.ptr + o, "n": 2 * n, "dtype": int(dtype == FP16),
                     "nblocks": km.units_fp8(2 * n)})
        outs.append((o, n))
        off += n
        o += -(-n // 64) * 64
    meta = launch(kern, "okv_fp8_encode", rows, kern.crc_tables)
    got = out.get()
    for (o, n), s, m in zip(outs, srcs, meta):
        want = (table[s] & 0xFF).astype(np.uint8)
        assert np.array_equal(got[o:o + n], want)
        assert int(finish_crc(m["acc"], n)) == crc32c.crc32c(want.tobytes())
        assert int(m["status"]) == 0


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fp8_decode_every_code(kern: km.Kernels, dtype: np.dtype) -> None:
    codes = np.tile(np.arange(256, dtype=np.uint8), 129)[: 256 * 129]
    src = cp.asarray(codes)
    out = cp.full(codes.size, 0xA5A5, dtype=np.uint16)
    rows = [{"src": src.data.ptr, "dst": out.data.ptr, "n": 2 * codes.size, "dtype": int(dtype == FP16),
             "nblocks": km.units_fp8(2 * codes.size)}]
    launch(kern, "okv_fp8_decode", rows)
    assert np.array_equal(out.get(), _DEC[dtype][codes])


def test_fp8_decode_skips_segment_with_bad_crc(kern: km.Kernels) -> None:
    src = cp.asarray(np.arange(256, dtype=np.uint8))
    out = cp.full(256, 0xA5A5, dtype=np.uint16)
    rows = [{"src": src.data.ptr, "dst": out.data.ptr, "n": 512, "expect_crc": 1234, "nblocks": 1}]
    launch(kern, "okv_fp8_decode", rows)  # meta.acc is 0, the descriptor expects 1234: nothing may be written
    assert bool((out == 0xA5A5).all())


def test_crc32c_lengths_and_offsets() -> None:
    kern = km.kernels()
    rng = np.random.default_rng(11)
    host = rng.integers(0, 256, (16 << 20) + 64, dtype=np.uint8)
    buf = cp.asarray(host)
    lengths = list(range(1, 300)) + [2 ** k + d for k in range(9, 25) for d in (-1, 0, 1)]
    lengths += [int(x) for x in rng.integers(1, 16 << 20, 40)]
    lengths = [n for n in lengths if n <= 16 << 20]
    rows, cases = [], []
    for i, n in enumerate(lengths):
        off = int(rng.integers(0, 64)) if i % 3 else (i % 16)
        rows.append({"src": buf.data.ptr + off, "n": n, "nblocks": km.units_bytes(n)})
        cases.append((off, n))
    meta = launch(kern, "okv_crc32c", rows, kern.crc_tables)
    got = finish_crc(meta["acc"], np.array([n for _, n in cases]))
    for (off, n), c in zip(cases, got):
        assert int(c) == crc32c.crc32c(memoryview(host)[off:off + n]), (off, n)


def test_crc32c_copy_writes_every_byte() -> None:
    kern = km.kernels()
    rng = np.random.default_rng(12)
    for off in (0, 3):
        n = 3 * 16384 + 77
        host = rng.integers(0, 256, n + 16, dtype=np.uint8)
        src = cp.asarray(host)
        dst = cp.full(n + 64, 0xA5, dtype=np.uint8)
        meta = launch(kern, "okv_crc32c", [{"src": src.data.ptr + off, "dst": dst.data.ptr, "n": n,
                                            "nblocks": km.units_bytes(n)}], kern.crc_tables)
        got = dst.get()
        assert np.array_equal(got[:n], host[off:off + n]) and bool((got[n:] == 0xA5).all())
        assert int(finish_crc(meta[0]["acc"], n)) == crc32c.crc32c(host[off:off + n].tobytes())


def test_crc32c_copy_alignments_and_device_length() -> None:
    """The braided CRC kernel's paths: 8-byte aligned or not, source and destination separately; whole and
    partial units; a device-side length (n_dev) shorter than n, with units past it contributing nothing."""
    kern = km.kernels()
    rng = np.random.default_rng(14)
    n = 4 * 16384 + 13
    host = rng.integers(0, 256, n + 64, dtype=np.uint8)
    src = cp.asarray(host)
    for soff, doff in ((0, 0), (8, 3), (5, 0), (1, 7)):
        dst = cp.full(n + 64, 0xA5, dtype=np.uint8)
        meta = launch(kern, "okv_crc32c", [{"src": src.data.ptr + soff, "dst": dst.data.ptr + doff, "n": n,
                                            "nblocks": km.units_bytes(n)}], kern.crc_tables)
        got = dst.get()
        assert np.array_equal(got[doff:doff + n], host[soff:soff + n]), (soff, doff)
        assert bool((got[:doff] == 0xA5).all()) and bool((got[doff + n:] == 0xA5).all())
        assert int(finish_crc(meta[0]["acc"], n)) == crc32c.crc32c(host[soff:soff + n].tobytes()), (soff, doff)
    real = [1, 8, 16383, 16384, 16385, 2 * 16384 + 40, n]
    lens = cp.asarray(np.array(real, dtype=np.uint64))
    rows = [{"src": src.data.ptr + (8 * i) % 24, "n": n, "n_dev": lens.data.ptr + 8 * i, "nblocks": km.units_bytes(n)}
            for i in range(len(real))]
    meta = launch(kern, "okv_crc32c", rows, kern.crc_tables)
    for i, r in enumerate(real):
        o = (8 * i) % 24
        assert int(finish_crc(meta[i]["acc"], r)) == crc32c.crc32c(host[o:o + r].tobytes()), r


def test_crc32c_sixteen_mib_every_offset_class() -> None:
    kern = km.kernels()
    host = np.random.default_rng(13).integers(0, 256, (16 << 20) + 16, dtype=np.uint8)
    buf = cp.asarray(host)
    rows = [{"src": buf.data.ptr + off, "n": 16 << 20, "nblocks": km.units_bytes(16 << 20)} for off in range(16)]
    meta = launch(kern, "okv_crc32c", rows, kern.crc_tables)
    for off, m in enumerate(meta):
        assert int(finish_crc(m["acc"], 16 << 20)) == crc32c.crc32c(memoryview(host)[off:off + (16 << 20)])


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_key_encode_any_alignment_and_length(head_dim: int, bits: int) -> None:
    """The K encode stages sources and records per warp in 16-byte pieces: sources at 2-byte offsets take
    the unaligned load, records at odd 2-byte offsets the byte copy, and segments that end inside a warp
    pass or a work unit write their records and not one byte more (the poison around them survives)."""
    from orbitkv_fs.codecs.turboquant import encode_key
    from orbitkv_fs.gpu.tables import sign_words
    from orbitkv_fs.segment import Role, turboquant_record_bytes

    kern = km.kernels()
    rng = np.random.default_rng(head_dim * 10 + bits)
    rec = turboquant_record_bytes(head_dim, bits, Role.KEY)
    for nvec, src_off, dst_off in ((1, 0, 0), (37, 2, 2), (300, 6, 0), (16384 // head_dim + 5, 8, 14), (2049, 0, 34)):
        x = (rng.standard_normal((nvec, head_dim)) * 3).astype(np.float32).astype(BF16)
        raw = np.zeros(x.nbytes + 64, dtype=np.uint8)
        raw[src_off:src_off + x.nbytes] = x.view(np.uint8).reshape(-1)
        src = cp.asarray(raw)
        dst = cp.full(nvec * rec + 128, 0xA5, dtype=np.uint8)
        meta = launch(kern, "okv_tq_encode_k", [{
            "src": src.data.ptr + src_off, "dst": dst.data.ptr + 64 + dst_off, "n": x.nbytes, "dtype": 0,
            "head_dim": head_dim, "bits": bits, "role": int(Role.KEY), "signs": sign_words(head_dim, 5, 0),
            "nblocks": km.units_tq(x.nbytes, head_dim)}], table=kern.tq_tables)
        assert int(meta["status"][0]) == 0
        got = dst.get()
        want = encode_key(x.astype(np.float32), bits, 5, 0)
        assert np.array_equal(got[64 + dst_off:64 + dst_off + nvec * rec], want.reshape(-1)), (nvec, src_off, dst_off)
        assert np.all(got[:64 + dst_off] == 0xA5) and np.all(got[64 + dst_off + nvec * rec:] == 0xA5)


def test_check_device_accepts_this_gpu_and_refuses_older_ones() -> None:
    """The kernels need compute capability 8.0 (cp.async) and the K encode's shared memory: an older GPU is a
    clear CodecUnavailable (the Manager then uses the host codecs), not a failed launch at the first save."""
    from orbitkv_fs.errors import CodecUnavailable

    km.check_device()
    props = dict(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id))
    assert int(props["sharedMemPerBlockOptin"]) >= km.DYNAMIC_SMEM["okv_tq_encode_k"]
    with pytest.raises(CodecUnavailable, match="compute capability"):
        km.check_device({**props, "major": 7, "minor": 5})
    with pytest.raises(CodecUnavailable, match="shared memory"):
        km.check_device({**props, "sharedMemPerBlockOptin": 64 << 10})
