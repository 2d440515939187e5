"""Whole-chunk gather and scatter of engine blocks (``_Seg.gather`` / ``_Seg.scatter``, the GPU path's
one-launch-per-tensor moves) against the per-block views, on host pages of every block layout; and the
arena bookkeeping of segments the GPU engine writes in place (``_gaps``)."""

from __future__ import annotations

import contextlib
import random

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.manager.device import _block_table, _geometry, _rows_of, _run_of, _table_of, _Targets
from orbitkv_fs.manager.save import _gaps
from orbitkv_fs.manager.api import SKIP_BLOCK
from orbitkv_fs.pages import BLOCK_COPY_DTYPE, host_engine_pages

L, B, T, H, D = 2, 12, 4, 2, 32


@contextlib.contextmanager
def registered_engine(layout: str, seed: int):
    """The Manager's registration of a host engine of ``layout`` filled with random BF16, and the rng."""
    pages, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D, layout=layout)
    try:
        rng = np.random.default_rng(seed)
        for name in pages.tensors:
            a = pages.array(name)
            a[...] = rng.standard_normal(a.shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        attention = "mla" if layout == "mla" else "gqa"
        reg = EngineRegistration(model="gs", num_layers=L, layer_start=0, layer_end=L, block_size=T, num_heads=H,
                                 head_dim=D, dtype="bfloat16", tensors=descs, attention=attention)
        with Manager(ManagerConfig(pool_size=8 << 20, device="cpu")) as m:
            e = m.register_engine(reg)
            yield m._engines[e.engine_id], rng
    finally:
        pages.close()


@contextlib.contextmanager
def registered_segments(layout: str, seed: int):
    """The Manager segments of :func:`registered_engine`, and the rng."""
    with registered_engine(layout, seed) as (eng, rng):
        yield eng.segs, rng


@pytest.mark.parametrize("blocks", [[7, 2, 11, 3], [4, 5, 6, 7], [9]], ids=["scattered", "run", "one"])
@pytest.mark.parametrize("layout", ["separate", "vllm_packed", "sglang_token_pool", "mla"])
def test_gather_and_scatter_match_block_views(layout, blocks):
    with registered_segments(layout, 1) as (segs, rng):
        for seg in segs:
            before = {b: np.array(seg.view(b)) for b in range(B)}
            got = seg.gather(blocks)
            assert got.flags.c_contiguous and got.shape == (len(blocks),) + seg.block_shape
            assert all(np.array_equal(got[j], before[b]) for j, b in enumerate(blocks))
            new = np.asarray(rng.standard_normal(got.shape, dtype=np.float32)).astype(got.dtype)
            seg.scatter(blocks, new)
            for b in range(B):  # the named blocks take the new values, no other block changes
                want = new[blocks.index(b)] if b in blocks else before[b]
                assert np.array_equal(seg.view(b), want), (layout, seg.layer, seg.role, b)


def _gaps_of(regions, used):
    return _gaps(regions, np.array([o for o, _ in used], dtype=np.int64), np.array([n for _, n in used], dtype=np.int64))


def test_gaps_partition_regions():
    regions = [(0, 8192), (16384, 2048)]
    used = [(512, 1024), (2048, 512), (16384, 2048)]
    gaps = _gaps_of(regions, used)
    assert gaps == [(0, 512), (1536, 512), (2560, 5632)]
    covered = sorted(used + gaps)
    assert sum(n for _, n in covered) == sum(n for _, n in regions)  # every unit freed or published once
    assert _gaps_of([(0, 4096)], []) == [(0, 4096)]
    assert _gaps_of([(0, 4096)], [(0, 4096)]) == []


@pytest.mark.parametrize("seed", range(30))
def test_gaps_are_the_units_no_extent_covers(seed):
    """Against a unit-by-unit model: regions apart, extents in any order, at region edges, back to back,
    some outside every region (a fallback's own reservation)."""
    rng = random.Random(seed)
    unit, regions, pos = 512, [], 0
    for _ in range(rng.randrange(1, 4)):
        pos += rng.randrange(0, 4) * unit
        n = rng.randrange(1, 40) * unit
        regions.append((pos, n))
        pos += n
    used, at = [], 0
    while at < pos + 8 * unit:
        at += rng.choice([0, 0, 1, 3]) * unit
        n = rng.randrange(1, 6) * unit
        if rng.random() < 0.6:
            used.append((at, n))
        at += n
    rng.shuffle(used)
    free = {u for o, n in regions for u in range(o, o + n, unit)} - {u for o, n in used for u in range(o, o + n, unit)}
    gaps = _gaps_of(regions, used)
    got = [u for o, n in gaps for u in range(o, o + n, unit)]
    assert sorted(got) == sorted(free) and len(got) == len(set(got))
    assert all(n > 0 for _, n in gaps)


def _apply_block_table(table: np.ndarray, memory: np.ndarray) -> None:
    """What ``okv_copy_blocks`` does, on a host byte array whose offsets stand for device addresses."""
    for row in table:
        rows, n = int(row["rows"]), int(row["row_bytes"])
        for r in range(rows):
            s = int(row["src"]) + r * int(row["src_stride"])
            d = int(row["dst"]) + r * int(row["dst_stride"])
            memory[d:d + n] = memory[s:s + n].copy()


@pytest.mark.parametrize("layout", ["separate", "vllm_packed", "sglang_token_pool", "mla"])
def test_block_tables_gather_and_scatter_like_the_block_views(layout):
    """The block-copy tables of the GPU path (``_rows_of`` + ``_block_table``), applied by a model of the
    kernel to the bytes of host pages: gathering equals ``seg.gather``, scattering writes exactly the blocks."""
    blocks = [7, 2, 11, 3]
    with registered_segments(layout, 2) as (segs, rng):
        for seg in segs:
            base = seg.base
            arr = base.base if base.base is not None else base
            while arr.base is not None and isinstance(arr.base, np.ndarray):
                arr = arr.base
            memory = np.frombuffer(arr, dtype=np.uint8) if not isinstance(arr, np.ndarray) else arr.view(np.uint8).reshape(-1)
            origin = memory.ctypes.data
            rows = _rows_of(seg.block_shape, base.strides[1:], seg.dtype.itemsize)
            assert rows is not None, layout
            assert rows[0] * rows[1] == seg.block_bytes
            seg.copy = (base.ctypes.data - origin, base.strides[0]) + rows
            want = seg.gather(blocks)
            n = want.nbytes
            scratch = np.zeros(memory.size + n, dtype=np.uint8)  # pages, then the gather buffer
            scratch[:memory.size] = memory
            _apply_block_table(_block_table([(seg, blocks, memory.size)], gather=True), scratch)
            assert np.array_equal(scratch[memory.size:], want.view(np.uint8).reshape(-1))
            before = scratch[:memory.size].copy()
            new = rng.integers(0, 256, n, dtype=np.uint8)
            scratch[memory.size:] = new
            _apply_block_table(_block_table([(seg, blocks, memory.size)], gather=False), scratch)
            memory[:] = scratch[:memory.size]  # the pages now hold what the scatter wrote
            got = seg.gather(blocks)
            assert np.array_equal(got.view(np.uint8).reshape(-1), new)
            others = [b for b in range(B) if b not in blocks]
            memory[:] = before
            kept = seg.gather(others)
            memory[:] = scratch[:memory.size]
            assert np.array_equal(seg.gather(others), kept)  # no other block changed
            seg.copy = None


@pytest.mark.parametrize("seed", range(25))
def test_table_rows_field_by_field(seed):
    """``_table_of`` against its rows written field by field: items of any block count (none, one, equal,
    unequal), blocks taken from anywhere in the id array (``starts``) or concatenated, restore skips left
    out of a scatter (their buffer place kept), never out of a gather."""
    rng = random.Random(seed)
    m = rng.randrange(1, 12)
    geo = np.array([[rng.getrandbits(40), rng.randrange(1, 1 << 20), rng.randrange(1, 9), rng.randrange(1, 4097),
                     rng.randrange(1, 1 << 14), rng.randrange(1, 1 << 16), rng.getrandbits(44)] for _ in range(m)],
                   dtype=np.uint64)
    counts = np.array([rng.choice([0, 1, 4, 4, rng.randrange(1, 9)]) for _ in range(m)], dtype=np.int64)
    pool = np.array([SKIP_BLOCK if rng.random() < 0.2 else rng.randrange(0, 5000) for _ in range(200)], dtype=np.int64)
    starts = np.array([rng.randrange(0, 200 - int(c)) for c in counts], dtype=np.int64)
    for gather in (True, False):
        for explicit in (True, False):
            ids = pool if explicit else np.concatenate([pool[a:a + c] for a, c in zip(starts, counts)] + [pool[:0]])
            got = _table_of(geo, ids, counts, gather=gather, starts=starts if explicit else None)
            want = []
            for (first, stride, rows, row_bytes, row_stride, block_bytes, addr), a, c in zip(geo.tolist(), starts.tolist(),
                                                                                               counts.tolist()):
                for b in range(c):
                    blk = int(pool[a + b])
                    if blk == SKIP_BLOCK and not gather:
                        continue
                    page, flat = (first + blk * stride) % (1 << 64), addr + b * block_bytes
                    src, dst = (page, flat) if gather else (flat, page)
                    strides = (row_stride, row_bytes) if gather else (row_bytes, row_stride)
                    want.append((src, dst) + strides + (rows, row_bytes))
            assert got.dtype == BLOCK_COPY_DTYPE
            assert got.tolist() == want, (gather, explicit)
    if counts.any():  # an item whose blocks run past the id array: refused, nothing read there
        i = int(np.flatnonzero(counts)[0])
        for bad in (len(pool) - int(counts[i]) + 1, -1):
            with pytest.raises(IndexError):
                _table_of(geo, pool, counts, gather=True, starts=np.where(np.arange(m) == i, bad, starts))


def test_rows_of_block_shapes():
    # contiguous block: one row
    assert _rows_of((4, 2, 32), (128, 64, 2), 2) == (1, 512, 512)
    # vLLM packed K half: heads x tokens rows of head_dim elements, 2 * head_dim apart
    assert _rows_of((2, 4, 32), (4 * 128, 128, 2), 2) == (8, 64, 128)
    # singleton dimensions are skipped
    assert _rows_of((1, 4, 1, 32), (999, 128, 7, 2), 2) == (4, 64, 128)
    # outer dimensions that do not step regularly cannot be one row stride
    assert _rows_of((2, 4, 32), (1000, 128, 2), 2) is None


@pytest.mark.parametrize("layout", ["separate", "vllm_packed", "sglang_token_pool", "mla"])
def test_targets_as_arrays_are_the_per_item_tables(layout):
    """``_Targets`` (a batch's places and block tables as arrays over (chunk, segment) pairs) against the
    per-item path: a pair used where it lies is a run of blocks that is one C-contiguous region there, at
    that region's address; the others get aligned places in one temporary; its gather and scatter tables
    are ``_block_table`` 's for the same items, row for row."""
    chunks = [ChunkBlocks(b"a" * 16, [7, 2, 11, 3]), ChunkBlocks(b"b" * 16, [4, 5, 6, 7]), ChunkBlocks(b"c" * 16, [9]),
              ChunkBlocks(b"d" * 16, [0, 1])]
    with registered_segments(layout, 3) as (segs, _):
        for seg in segs:
            rows = _rows_of(seg.block_shape, seg.base.strides[1:], seg.dtype.itemsize)
            seg.copy = (seg.base.ctypes.data, seg.base.strides[0]) + rows
        t = _Targets(chunks, segs)
        ci, si = np.divmod(np.arange(len(chunks) * len(segs)), len(segs))
        nbytes, direct, where, pos, size = t.places(ci, si)
        staged = []
        for j, (c, s) in enumerate(zip(ci.tolist(), si.tolist())):
            seg, blocks = segs[s], chunks[c].blocks
            assert nbytes[j] == len(blocks) * seg.block_bytes
            run = _run_of(blocks)
            if direct[j]:
                view = seg.base[run]
                assert view.flags.c_contiguous and where[j] == view.ctypes.data
            elif run is not None and run.stop - run.start > 1:
                assert not seg.base[run].flags.c_contiguous  # a longer run is used where it lies when it can be
            if not direct[j]:
                staged.append((seg, blocks))
        assert not direct.all() and (direct.any() or layout == "vllm_packed")  # K and V halves: never one region
        assert pos.tolist() == [sum(-(-len(b) * g.block_bytes // 256) * 256 for g, b in staged[:i]) for i in range(len(staged))]
        assert size == sum(-(-len(b) * g.block_bytes // 256) * 256 for g, b in staged)
        addr = 1 << 40
        for gather in (True, False):
            got = t.table(ci[~direct], si[~direct], addr + pos, gather=gather)
            want = _block_table([(g, b, addr + p) for (g, b), p in zip(staged, pos.tolist())], gather=gather)
            assert got.tobytes() == want.tobytes()
        for c, s in ((len(chunks), 0), (0, len(segs)), (-1, 0)):  # a pair that is not a target
            with pytest.raises(IndexError):
                t.places(np.asarray([0, c]), np.asarray([0, s]))
            with pytest.raises(IndexError):
                t.table(np.asarray([0, c]), np.asarray([0, s]), np.asarray([addr, addr]), gather=True)
        for seg in segs:
            seg.copy = None


def test_ans_rows_go_through_the_temporary_which_the_engine_writes_in_place():
    """``decode_rows_submit``: a row whose header is ANS is never decoded straight into its pages (the engine
    decompresses ANS in place, and a failed row's bytes must land where only passed rows are copied from: the
    temporary); other rows still go where they lie when they can; the engine is asked for ``in_place``.
    ``places(direct=mask)`` uses only the marked pairs where they lie."""
    import types

    from orbitkv_fs.manager.device import _GpuCodecs
    from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, Format

    chunks = [ChunkBlocks(b"a" * 16, [0, 1, 2, 3]), ChunkBlocks(b"b" * 16, [8, 9]), ChunkBlocks(b"c" * 16, [5, 4])]
    with registered_segments("separate", 3) as (segs, _):
        for seg in segs:
            seg.copy = (seg.base.ctypes.data, seg.base.strides[0]) + _rows_of(seg.block_shape, seg.base.strides[1:],
                                                                               seg.dtype.itemsize)
        t = _Targets(chunks, segs)
        rows = np.arange(len(chunks) * len(segs))
        ci, si = np.divmod(rows, len(segs))
        _, here, where, _, _ = t.places(ci, si)
        assert here.any() and not here.all()
        mask = rows % 2 == 0
        _, some, _, pos, size = t.places(ci, si, direct=mask)
        assert (some == here & mask).all()
        assert size == sum(-(-int(n) // 256) * 256 for n in t.places(ci, si, direct=False)[0][~some])
        heads = np.zeros((len(rows), HEADER_SIZE), np.uint8)
        heads[rows % 3 == 0, HEADER_DTYPE.fields["format"][1]] = int(Format.ANS)
        ans = rows % 3 == 0
        got = {}
        temp = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 44))

        def submit(heads, src, dst, nbytes, *, within=None, in_place=False):
            got.update(dst=dst.copy(), in_place=in_place)
            return types.SimpleNamespace()

        engine = types.SimpleNamespace(block_buffer=lambda n, restore: temp, decode_columns_submit=submit)
        g = object.__new__(_GpuCodecs)
        g.engine = lambda seed: engine
        db = g.decode_rows_submit(t, rows, heads, np.zeros(len(rows), np.int64), 0, within=np.zeros(1, np.uint8))
        assert got["in_place"] and (db.direct == here & ~ans).all()
        assert (got["dst"][db.direct] == where[db.direct]).all()
        assert (got["dst"][~db.direct] >= 1 << 44).all() and ans[here].any()  # some ANS row could have gone direct
        for seg in segs:
            seg.copy = None


def test_save_columns_pairs_and_classes():
    """A save batch of GPU pages as arrays (``SavePipeline._save_columns``): each item's chunk and segment
    index, and its encode class, made once per (segment, chunk size) for the registration, whatever the
    batches; chunks of different sizes and partly cached chunks in one batch; a class the array path does
    not take (one the host codec decides) sends the batch to the item path."""
    from types import SimpleNamespace

    from orbitkv_fs.manager.save import SavePipeline
    from save_rows import rows_of

    segs = [SimpleNamespace(layer=i // 2, block_bytes=4096, block_shape=(16, 128), copy=(1 << 30 + i, 4096, 1, 4096, 4096))
            for i in range(6)]
    eng = SimpleNamespace(segs=segs, seg_index={id(s): i for i, s in enumerate(segs)}, enc_classes={},
                          enc_rows={}, geometry=_geometry(segs))
    made = []

    def encode_class(engine, seg, blocks):
        made.append((segs.index(seg), blocks))
        return SimpleNamespace(kind="host" if seg.layer == 9 else ("ans" if seg.layer == 1 else "fp8"),
                               key=(segs.index(seg), blocks))

    p = SimpleNamespace(_gpu_codecs=SimpleNamespace(encode_class=encode_class))
    chunks = [ChunkBlocks(bytes([c]) * 16, list(range(4 * c, 4 * c + n))) for c, n in enumerate((2, 3, 2, 1))]
    items = [(ch, segs[s], b"k") for ch, picked in zip(chunks, ([0, 1, 2, 3, 4, 5], [1, 4], [0, 5], [2]))
             for s in picked]
    # a chunk split over two batches, then all at once, then the first batch again (from the caches)
    for batch in (items[:7], items[7:], items, items[:7]):
        targets, classes, cls, ci, si = SavePipeline._save_columns(p, eng, None, rows_of(batch, segs))
        assert [segs[s] for s in si.tolist()] == [it[1] for it in batch]
        assert [targets.counts[c] for c in ci.tolist()] == [len(it[0].blocks) for it in batch]
        assert [classes[c].key for c in cls.tolist()] == [(segs.index(seg), len(ch.blocks)) for ch, seg, _ in batch]
        assert (np.diff(ci) >= 0).all() and set(np.diff(ci).tolist()) <= {0, 1}
    assert len(made) == len(set(made))  # each class made once, whatever the batches
    assert len(eng.enc_rows) == 3  # the fourth batch's pairs were the first's: answered without sorting them again
    segs[3].layer = 9  # its class is the host codec's: the whole batch goes to the item path (a new registration)
    eng.enc_classes.clear()
    eng.enc_rows.clear()
    assert SavePipeline._save_columns(p, eng, None, rows_of(items, segs)) is None
    eng.geometry = None  # pages the block-copy kernel cannot move: the item path
    segs[3].layer = 1
    eng.enc_classes.clear()
    eng.enc_rows.clear()
    assert SavePipeline._save_columns(p, eng, None, rows_of(items, segs)) is None


@pytest.mark.parametrize("counts", [[16, 16, 16, 16], [4, 1, 7, 2], [3]])
def test_block_copy_rows_are_each_blocks_addresses(counts):
    """``_table_of`` (the block-copy rows of a batch, built as arrays: an item's row repeated per block, with a
    grid for items of equal block counts) against each block's addresses written out one by one; a scatter
    leaves out the SKIP_BLOCK positions, a gather keeps every position."""
    from orbitkv_fs.manager.api import SKIP_BLOCK
    from orbitkv_fs.manager.device import _table_of

    rng = np.random.default_rng(len(counts))
    m = len(counts)
    geo = np.zeros((m, 7), dtype=np.uint64)  # block 0, block stride, rows, row bytes, row stride, block bytes, buffer
    geo[:, 0] = rng.integers(1 << 30, 1 << 40, m)
    geo[:, 1] = rng.integers(1, 1 << 16, m) * 256
    geo[:, 2] = rng.integers(1, 9, m)
    geo[:, 3] = rng.integers(1, 64, m) * 16
    geo[:, 4] = geo[:, 3] * rng.integers(1, 3, m).astype(np.uint64)
    geo[:, 5] = geo[:, 2] * geo[:, 3]
    geo[:, 6] = (1 << 42) + np.arange(m, dtype=np.uint64) * (1 << 24)
    ids = rng.integers(0, 4096, sum(counts))
    ids[::5] = SKIP_BLOCK
    for gather in (True, False):
        want = []
        at = 0
        for i, c in enumerate(counts):
            g = [int(x) for x in geo[i]]
            for w in range(c):
                b = int(ids[at + w])
                if b == SKIP_BLOCK and not gather:
                    continue
                page, flat = g[0] + (b % (1 << 64)) * g[1], g[6] + w * g[5]
                src, dst = (page, flat) if gather else (flat, page)
                strides = (g[4], g[3]) if gather else (g[3], g[4])
                want.append((src % (1 << 64), dst % (1 << 64)) + strides + (g[2], g[3]))
            at += c
        got = _table_of(geo.copy(), ids, np.array(counts), gather=gather)
        assert [tuple(int(v) for v in row) for row in got.tolist()] == want


@pytest.mark.parametrize("seed", range(3))
def test_save_rows_carry_the_key_scan_of_their_keys(seed):
    """``SaveRows.join`` 's run starts and the registration's subs (``_Engine.subs``) are what the index's own
    scan reads from the batch's keys, for batches of whole and partial chunks of a real registration; a batch
    naming a chunk twice (its runs then no longer one per prefix) carries none, and the index scans it."""
    from orbitkv_fs.index import _scan_keys
    from orbitkv_fs.manager.save import SaveRows

    rnd = random.Random(seed)
    seen = {"distinct": 0, "twice": 0}
    with registered_engine("separate", seed) as (eng, _):
        nseg = len(eng.segs)
        for _ in range(40):
            pieces = []
            for _ in range(rnd.randrange(1, 6)):
                ch = ChunkBlocks(bytes([rnd.randrange(4 if rnd.random() < 0.3 else 256)]) * 16, [0])
                si = np.asarray(sorted(rnd.sample(range(nseg), rnd.randrange(1, nseg + 1))), dtype=np.int64)
                keys = [eng.ns + ch.key + eng.tails[i] for i in si.tolist()]
                lo = rnd.randrange(len(keys))
                pieces.append(((ch, si, keys), lo, rnd.randrange(lo + 1, len(keys) + 1)))
            rows = SaveRows.join(pieces)
            subs, starts = _scan_keys(rows.keys)
            if len({ch.key for ch in rows.chunks}) < len(rows.chunks):
                assert rows.starts is None
                seen["twice"] += 1
                continue
            assert rows.starts == starts
            assert eng.subs[rows.si].tolist() == subs.tolist()
            seen["distinct"] += 1
    assert seen["distinct"] > 10 and seen["twice"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_target_layout_columns_are_the_per_chunk_and_per_segment_rules(seed):
    """``_layout`` (``_Targets``' columns in one compiled pass) against the rules it replaces: a chunk is a run
    when ``_run_of`` finds one (ascending, consecutive, no ``SKIP_BLOCK``; a chunk of no blocks is none), its
    first block and its place in the flattened blocks; a segment is contiguous when its blocks lie back to back,
    each of regular contiguous rows."""
    from orbitkv_fs.manager.device import _layout

    rng = random.Random(seed)
    blocks = []
    for _ in range(40):
        n = rng.choice([0, 1, 2, 3, 16])
        first = rng.randrange(0, 50)
        b = list(range(first, first + n))
        kind = rng.random()
        if n and kind < 0.3:
            b[rng.randrange(n)] = SKIP_BLOCK
        elif n > 1 and kind < 0.6:
            b[rng.randrange(1, n)] += rng.choice([-1, 1, 7])
        blocks.append(b)
    counts = np.array([len(b) for b in blocks], np.int64)
    flat = np.array([x for b in blocks for x in b], np.int64)
    geo = []
    for s in range(30):  # block 0, block stride, rows, row bytes, row stride, block bytes, address
        rows, row = rng.choice([1, 2, 4]), rng.choice([32, 64])
        if s % 2:  # contiguous: blocks back to back of rows back to back (one row: any stride), unless one is off
            nb, stride, row_stride = rows * row, rows * row, row if rows > 1 else rng.choice([row, 4096])
            stride, row_stride = rng.choice([(stride, row_stride), (stride, row_stride), (2 * nb, row_stride),
                                             (stride, row_stride + 16 * (rows > 1))])
        else:
            nb, stride, row_stride = rng.choice([64, 128, 256]), rng.choice([64, 128, 256]), rng.choice([32, 64, 128])
        geo.append([rng.randrange(1 << 40), stride, rows, row, row_stride, nb, 0])
    geo = np.array(geo, np.uint64)
    block_bytes, contig, start, first, run = _layout(geo, flat, counts)
    g = geo.astype(np.int64)
    assert block_bytes.tolist() == g[:, 5].tolist()
    want = (g[:, 1] == g[:, 5]) & (g[:, 2] * g[:, 3] == g[:, 5]) & ((g[:, 2] == 1) | (g[:, 4] == g[:, 3]))
    assert contig.tolist() == want.tolist() and want.any() and not want.all()
    assert start.tolist() == (np.cumsum(counts) - counts).tolist()
    assert first.tolist() == [b[0] if b else 0 for b in blocks]
    assert run.tolist() == [bool(b) and _run_of(b) is not None for b in blocks]
    assert run.any() and not run.all()


@pytest.mark.parametrize("seed", range(3))
def test_segments_in_a_batchs_regions(seed):
    """``_in_regions`` (which of a finished save batch's segments the engine wrote into its arena regions, and
    their extents in whole units) and ``_job_rows`` (a job's Formats and arena offsets, -1 without an address)
    against the same in numpy, with segments at a region's first and last byte, just past it, and outside."""
    from orbitkv_fs.manager.save import _in_regions, _job_rows
    from orbitkv_fs.tiers.dram import UNIT

    rng = np.random.default_rng(seed)
    pos = np.sort(rng.choice(1000, 3, replace=False)) * (4 * UNIT)
    n = rng.integers(1, 4, 3) * UNIT
    off = np.concatenate([pos, pos + n - 1, pos + n, rng.integers(0, 4000 * UNIT, 40), [-1]]).astype(np.int64)
    length = rng.integers(1, 3 * UNIT, len(off)).astype(np.int64)
    placed, extent, count = _in_regions(off, length, pos.astype(np.int64), n.astype(np.int64), UNIT)
    want = np.zeros(len(off), bool)
    for o, m in zip(pos, n):
        want |= (off >= o) & (off < o + m)
    assert placed.tolist() == want.tolist() and count == want.sum() and 0 < count < len(off)
    assert extent.tolist() == (-(-length // UNIT) * UNIT).tolist()
    fmt = rng.integers(-1, 4, len(off)).astype(np.int16)
    addr = np.where(rng.random(len(off)) < 0.2, 0, rng.integers(1 << 30, 1 << 31, len(off))).astype(np.int64)
    f, at, others = _job_rows(fmt, addr, 1 << 30)
    assert f.dtype == np.int64 and f.tolist() == fmt.tolist() and others == (fmt < 0).sum()
    assert at.tolist() == np.where(addr == 0, -1, addr - (1 << 30)).tolist()
