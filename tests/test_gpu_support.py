"""Host-side parts of the GPU codec engine that need no GPU: the CRC32C combine model and the
nvCOMP loader's start-up errors. (The kernels themselves are tested in the gpu-marked tests.)"""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest

from orbitkv_fs.errors import CodecUnavailable
from orbitkv_fs.gpu import tables


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 65, 127, 1000, 16383, 16384, 16385, 2 * 16384 + 5, 3 * 16384])
def test_crc_model_equals_crc32c(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert tables.crc32c_model(data) == crc32c.crc32c(data)


def test_crc_tables_layout() -> None:
    t = tables.crc_tables()
    assert t.dtype == np.uint32 and t.size == tables.TABLES_SIZE
    assert tables.BRAID_OFFSET == tables.SHIFT_OFFSET + 128 * len(tables.SHIFT_BYTES)
    xp, xc = t[tables.XP_OFFSET:tables.XC_OFFSET], t[tables.XC_OFFSET:tables.SHIFT_OFFSET]
    assert xp[0] == tables.X0 and xc[0] == tables.X0 and xc[1] == xp[tables.CHUNK]
    # x^(8a) * x^(8b) = x^(8(a+b))
    assert tables.gf_mul(int(xp[100]), int(xp[200])) == xp[300]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 63, 64, 65, 1000, 2047, 2048, 2049, 16383, 16384, 16385,
                               2 * 16384 + 5, 3 * 16384, 5 * 16384 + 4099])
def test_crc_braid_model_equals_crc32c(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert tables.crc32c_braid_model(data) == crc32c.crc32c(data)


def test_crc_braid_tables_and_inverse_shifts() -> None:
    t = tables.crc_tables()
    xp, xn = t[tables.XP_OFFSET:], t[tables.XN_OFFSET:]
    for d in (1, 8, 255, 4096, tables.CHUNK):  # x^(8d) * x^(-8d) = 1
        assert tables.gf_mul(int(xp[d]), int(xn[d])) == tables.X0
    # a region split anywhere: units at arbitrary starts, shifted to the region's end (okv_ans_pack)
    data = np.random.default_rng(3).integers(0, 256, 50000, dtype=np.uint8).tobytes()
    acc = 0
    for a, b in ((0, 1032), (1032, 1032 + 16384), (1032 + 16384, 30000), (30000, 46384), (46384, 50000)):
        u = tables.braid_unit_raw(data[a:b])
        m = tables.okv_unit_mult(a, len(data))
        acc ^= tables.gf_mul(u, m) if m != tables.X0 else u
    assert int(tables.finish_crc(acc, len(data))) == crc32c.crc32c(data)


@pytest.mark.parametrize("saddr", [0x400, 0x800, 0x400 + 0x7000, 0x404, 0x10])
@pytest.mark.parametrize("n", [1, 9, 100, 16383, 16384, 16385, 2 * 16384 + 7])
def test_crc_braid_emulated_smem_any_array_address(saddr: int, n: int) -> None:
    """okv_load_braid's run-time placement keeps the OR-ed table addressing exact wherever the compiler and
    the hardware put the `sm` array (sm_90: window address 0x400 + its offset in the block's allocation)."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert tables.crc32c_braid_model(data, tables.braid_smem_layout(saddr)) == crc32c.crc32c(data)


def test_crc_braid_emulation_catches_misaligned_lane_tables() -> None:
    """The sm_90 placement of three separately declared __shared__ __align__(1024/2048/512) arrays (window
    base 0x400, offsets 0, 0x2000, 0x6000): the lane tables at 0x2400 are not 2048-aligned, so OR-ing a nibble
    >= 8 into their address reads the wrong row. The emulated kernel gives wrong CRCs there, as the H200 did."""
    data = np.random.default_rng(5).integers(0, 256, 16384, dtype=np.uint8).tobytes()
    assert tables.crc32c_braid_model(data, (0x400, 0x2400, 0x6400)) != crc32c.crc32c(data)
    assert tables.crc32c_braid_model(data, (0x400, 0x2800, 0x6800)) == crc32c.crc32c(data)


def test_braid_kernels_shared_declarations() -> None:
    """Every braided kernel declares its tables as okv_load_braid expects, and no __shared__ array relies on
    an alignment above 1024 bytes (sm_90 starts the static shared allocation at window address 0x400)."""
    import re
    from pathlib import Path

    kdir = Path(tables.__file__).parent / "kernels"
    common = (kdir / "common.cuh").read_text()
    m = re.search(r"#define OKV_BRAID_SMEM_WORDS \(OKV_LANE_WORDS \+ OKV_SLICE_WORDS \+ OKV_WARP_WORDS \+ (\d+)\)", common)
    assert m and tables.BRAID_SMEM_WORDS == tables.LANE_WORDS + tables.SLICE_WORDS + tables.WARP_WORDS + int(m.group(1))
    for name in ("crc32c.cu", "fp8.cu", "ans.cu", "turboquant.cu", "common.cuh"):
        src = (kdir / name).read_text()
        for a in re.findall(r"__shared__\s+__align__\((\d+)\)", src):
            assert int(a) <= 1024, (name, a)
        if name in ("crc32c.cu", "fp8.cu", "ans.cu"):
            assert "__shared__ __align__(1024) u32 sm[OKV_BRAID_SMEM_WORDS];" in src, name
            assert "okv_load_braid(sm, tables)" in src, name


def test_ans_pack_units_at_payload_offsets() -> None:
    """okv_ans_pack's units: the chunk table in CHUNK-byte units from 0, then each chunk's 8-byte aligned
    words in CHUNK-byte units from its payload offset, each shifted to the payload's end."""
    rng = np.random.default_rng(9)
    sizes = [65536 - 3, 40000, 17, 65536]
    table = 8 + 4 * len(sizes)
    start = table + (-table % 8)
    pieces = [(us, min(tables.CHUNK, start - us)) for us in range(0, start, tables.CHUNK)]
    off = start
    for sz in sizes:
        L = sz + (-sz % 8)
        pieces += [(off + us, min(tables.CHUNK, L - us)) for us in range(0, L, tables.CHUNK)]
        off += L
    data = rng.integers(0, 256, off, dtype=np.uint8).tobytes()
    acc = tables.braid_pieces_acc(data, pieces)
    assert int(tables.finish_crc(acc, len(data))) == crc32c.crc32c(data)


def test_sign_words_match_host_signs() -> None:
    from orbitkv_fs.codecs.turboquant import rotation_signs

    for d in (32, 64, 128, 256):
        words = tables.sign_words(d, 7, 3)
        bits = np.unpackbits(np.array(words, dtype="<u4").view(np.uint8), bitorder="little")[:d]
        assert np.array_equal(bits.astype(bool), rotation_signs(d, 7, 3) < 0)


def test_nvcomp_missing_library_is_a_clear_error(tmp_path) -> None:
    from orbitkv_fs.gpu import nvcomp

    with pytest.raises(CodecUnavailable, match="could not be loaded"):
        nvcomp.Nvcomp(str(tmp_path / "libnvcomp.so.5"))


def test_nvcomp_wrong_abi_is_a_clear_error() -> None:
    from orbitkv_fs.gpu import nvcomp

    libc = "libc.so.6"
    with pytest.raises(CodecUnavailable, match="lacks nvcompGetProperties"):
        nvcomp.Nvcomp(libc)


@pytest.mark.skipif(not os.path.isfile(__import__("orbitkv_fs.gpu.nvcomp", fromlist=["x"]).library_path()),
                    reason="nvidia-libnvcomp-cu13 not installed here")
def test_nvcomp_loads_and_reports_version() -> None:
    from orbitkv_fs.gpu import nvcomp

    nv = nvcomp.load()
    assert nv.version[:2] >= (5, 3)
    assert max(nv.compress_alignment) <= 256


def test_ans_payload_table_round_trip_and_errors() -> None:
    from orbitkv_fs.errors import LengthMismatch, UnknownFormat
    from orbitkv_fs.gpu import ans_format

    chunks = [b"abcdefghij", b"k" * 8, b"xyz"]
    payload = ans_format.pack(chunks)
    original = 2 * ans_format.CHUNK_BYTES + 5
    offsets, sizes = ans_format.parse(payload, original)
    assert [payload[o:o + s] for o, s in zip(offsets, sizes)] == chunks
    assert all(o % 8 == 0 for o in offsets) and len(payload) % 8 == 0
    with pytest.raises(LengthMismatch):
        ans_format.parse(payload, original + ans_format.CHUNK_BYTES)  # wrong chunk count
    with pytest.raises(LengthMismatch):
        ans_format.parse(payload[:-8], original)  # truncated
    bad = bytearray(payload)
    bad[0] = 1
    with pytest.raises(UnknownFormat):
        ans_format.parse(bytes(bad), original)


@pytest.mark.parametrize("n", [4096, 5000, 65536, 1 << 20, 16 << 20])
def test_ans_keep_capacity_is_the_keep_boundary(n: int) -> None:
    from orbitkv_fs.gpu import ans_format
    from orbitkv_fs.segment import worth_keeping

    cap = ans_format.keep_capacity(n)
    assert worth_keeping(n, cap) and not worth_keeping(n, cap + 1)


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_cell_bucketize_equals_host(bits: int) -> None:
    """The kernels' cell bucketize (cell byte, boundary slot, centroid) counts the boundaries below q exactly as the host,
    at the boundaries themselves, at the cells' edges, one ulp either side of both, where the cell index
    saturates, far outside the table and at +-0."""
    from orbitkv_fs.codecs.turboquant import lloyd_max_boundaries

    b = lloyd_max_boundaries(bits).astype(np.float32)
    edges = ((np.arange(tables.TQ_CELLS + 1) - 64) / 16).astype(np.float32)
    marks = np.concatenate([b, edges])
    q = np.concatenate([np.random.default_rng(bits).standard_normal(200_000).astype(np.float32) * 3, marks,
                        np.nextafter(marks, np.float32(np.inf)), np.nextafter(marks, np.float32(-np.inf)),
                        np.float32([0.0, -0.0, -4, 4, -3.99, 3.99, 4.02, 4.04, -4.04, 1e30, -1e30, 17, -17,
                                    1e-30, -1e-30])]).astype(np.float32)
    assert np.array_equal(tables.bucketize_by_cells(q, bits), np.searchsorted(b, q, side="left"))
    t = tables.turboquant_tables()
    cb, bt = (tables.TQ_CELLB4, tables.TQ_B4) if bits == 4 else (tables.TQ_CELLB3, tables.TQ_B3)
    assert np.array_equal(t.view(np.uint8)[4 * cb:4 * cb + tables.TQ_CELLS], tables.turboquant_cells(bits))
    assert np.array_equal(t[bt:bt + 2 ** bits], tables.turboquant_boundary_slots(bits))


def test_turboquant_table_offsets_are_the_kernels() -> None:
    """turboquant.cu reads the table at its #define offsets: they are the ones turboquant_tables lays out,
    and the regions do not overlap."""
    import re
    from pathlib import Path

    src = (Path(tables.__file__).parent / "kernels" / "turboquant.cu").read_text()
    defs = {k: int(v) for k, v in re.findall(r"#define (TQ_\w+) (\d+)", src)}
    names = ("TQ_C4", "TQ_C3", "TQ_B4", "TQ_B3", "TQ_CELLB4", "TQ_CELLB3")
    assert defs == {**{n: getattr(tables, n) for n in names}, "TQ_TAB": tables.TQ_TABLE_SIZE}
    sizes = {"TQ_C4": 16, "TQ_C3": 8, "TQ_B4": 16, "TQ_B3": 8, "TQ_CELLB4": -(-tables.TQ_CELLS // 4),
             "TQ_CELLB3": -(-tables.TQ_CELLS // 4)}
    spans = sorted((defs[n], defs[n] + sizes[n]) for n in names)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= tables.TQ_TABLE_SIZE
    t = tables.turboquant_tables()
    from orbitkv_fs.codecs.turboquant import lloyd_max_centroids

    assert np.array_equal(t[tables.TQ_C4:tables.TQ_C4 + 16], lloyd_max_centroids(4).astype(np.float32))
    assert np.array_equal(t[tables.TQ_C3:tables.TQ_C3 + 8], lloyd_max_centroids(3).astype(np.float32))


def test_turboquant_cells_refuse_two_boundaries_in_a_cell(monkeypatch) -> None:
    """A codebook whose boundaries are closer than a widened cell cannot use the cell bucketize."""
    close = np.float32([-0.5, -0.49, 0.0, 0.5])
    monkeypatch.setattr(tables, "lloyd_max_boundaries", lambda bits: close)
    with pytest.raises(ValueError, match="boundaries"):
        tables.turboquant_cells(3)


def test_zero_crc_is_crc32c_of_zeros_at_every_length_class() -> None:
    """The compiled zero_crc against crc32c of that many zero bytes: both table halves (within a 16 KiB unit
    and whole units), the largest stored segment, repeats and shapes; against the numpy multiplies too."""
    rng = np.random.default_rng(11)
    ns = np.concatenate([rng.integers(0, 1 << 22, 60), [0, 1, 63, 64, tables.CHUNK - 1, tables.CHUNK,
                                                        tables.CHUNK + 1, (tables.XC_COUNT - 1) * tables.CHUNK]])
    ns = np.concatenate([ns, ns[:9]]).astype(np.int64)
    got = tables.zero_crc(ns)
    assert got.dtype == np.uint32
    assert got.tolist() == [crc32c.crc32c(bytes(int(n))) for n in ns]
    numpy_form = tables.gf_mul_vec(np.uint32(0xFFFFFFFF), tables.x8n(ns)) ^ np.uint32(0xFFFFFFFF)
    assert np.array_equal(got, numpy_form)
    assert tables.zero_crc(np.array([[3, 4]])).shape == (1, 2) and int(tables.zero_crc(5)) == crc32c.crc32c(bytes(5))
    # the lengths it keeps at hand: more distinct ones than it keeps, cycled, then a few alternating
    cycle = np.array(list(range(100, 100 + 3 * tables._ZERO_MEMO)) * 2 + [7, 9, 7, 9, 7, 100], dtype=np.int64)
    assert tables.zero_crc(cycle).tolist() == [crc32c.crc32c(bytes(int(n))) for n in cycle]
    assert tables.finish_crc(np.uint32(0), 10).tolist() == crc32c.crc32c(bytes(10))


def test_parse_tables_equals_parse_table_payload_by_payload() -> None:
    """The compiled batch parse against the per-payload one on valid and damaged chunk tables (chunk size,
    count, one size, truncation, trailing bytes, a zero size): the same chunks, or the same error type and
    message; a payload outside the array is an error without a read."""
    from orbitkv_fs.gpu import ans_format as A

    rng = np.random.default_rng(7)
    blobs, origs, storeds = [], [], []
    for case in range(400):
        orig = int(rng.integers(1, 40 * A.CHUNK_BYTES))
        n = A.chunk_count(orig)
        payload = bytearray(A.pack([rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8) for _ in range(n)]))
        stored = len(payload)
        kind = case % 8
        if kind == 1:
            payload[0] ^= 1  # chunk size
        elif kind == 2:
            payload[4] += 1  # chunk count
        elif kind == 3:
            payload[8 + 4 * int(rng.integers(0, n))] ^= 8  # one chunk's size: the ends no longer add up
        elif kind == 4:
            stored = int(rng.integers(0, min(stored, 8 + 4 * n + 8)))  # truncated table
        elif kind == 5:
            payload += bytes(8)  # trailing bytes
            stored += 8
        elif kind == 6 and n > 1:  # a zero size whose padded bytes move to the next chunk: the ends still add up
            j = 8 + 4 * int(rng.integers(0, n - 1))
            z = int.from_bytes(payload[j:j + 4], "little")
            payload[j:j + 4] = bytes(4)
            payload[j + 4:j + 8] = (int.from_bytes(payload[j + 4:j + 8], "little") + (z + 7) // 8 * 8).to_bytes(4, "little")
        blobs.append(bytes(payload))
        origs.append(orig)
        storeds.append(stored)
    buf = np.zeros(sum(len(b) for b in blobs) + 64 * len(blobs) + 16, dtype=np.uint8)
    offs, pos = [], 3
    for b in blobs:
        buf[pos:pos + len(b)] = np.frombuffer(b, np.uint8)
        offs.append(pos)
        pos += len(b) + int(rng.integers(0, 64))
    # payloads past the array's end, and before its start (an address a peer or a caller got wrong)
    offs += [len(buf) - 10, -8]
    storeds += [100, 100]
    origs += [A.CHUNK_BYTES, A.CHUNK_BYTES]
    t = A.parse_tables(buf, np.array(offs), np.array(storeds), np.array(origs))
    kinds = set()
    for i, (o, stored, orig) in enumerate(zip(offs[:-2], storeds, origs)):
        try:
            want = A.parse_table(memoryview(buf)[o:o + stored], stored, orig)
        except (A.LengthMismatch, A.UnknownFormat) as e:
            got = A.table_error(t, i, stored, orig)
            assert type(got) is type(e) and str(got) == str(e), (i, got, e)
            kinds.add("".join(c for c in str(e) if not c.isdigit()))
            continue
        assert t.err[i] == 0
        c0, n = int(t.chunk0[i]), int(t.nch[i])
        assert np.array_equal(t.offsets[c0:c0 + n], want[0]) and np.array_equal(t.sizes[c0:c0 + n], want[1])
    for i in (len(offs) - 2, len(offs) - 1):
        assert t.err[i] != 0 and "outside" in str(A.table_error(t, i, 100, A.CHUNK_BYTES))
    assert len(kinds) == 6 and (t.err[:-2] == 0).sum() >= 100, kinds  # every kind of damage met, and valid ones
