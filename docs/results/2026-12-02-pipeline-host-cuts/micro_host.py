"""The per-batch host functions this stop cut, timed on the same inputs in whichever tree is importable
(best of many calls, microseconds per call): a batch of 256 segments of 72 (layer, role) classes, chunks of
16 blocks. Run once per tree, each laid out as the build maps it (orbitkv_fs/ with gpu/ inside), from a
directory that is not the checkout; cupy must import (no GPU is used) for the header writer:
  PYTHONPATH=TREE:CUPY_SITE python micro_host.py NAME OUT.json
Functions: ObjectIndex.add_many in steady state (every slot from the free list, 9 batches of 256 keys of
chunks of 72 segments), _Targets.table (gather rows of 256 pairs x 16 shuffled blocks), _table_of alone,
_verify_headers (256 raw 512 KiB headers), SavePipeline._save_columns (256 items), gpu.engine._write_headers
(256 headers into an output region whose slots lie on 64-byte boundaries)."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from orbitkv_fs.geometry import Role
from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import chunk_key, pack_key
from orbitkv_fs.manager.api import ChunkBlocks
from orbitkv_fs.manager.device import _geometry, _table_of, _Targets
from orbitkv_fs.manager.save import SavePipeline
from orbitkv_fs.manager.verify import _verify_headers
from orbitkv_fs.segment import HEADER_SIZE, Format, SegmentHeader, header_crcs, header_row

BF16 = np.dtype(ml_dtypes.bfloat16)


def best_us(f, calls: int = 200, rounds: int = 7) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def add_many_steady() -> float:
    keys = [pack_key(bytes(16), chunk_key(f"c{c}"), l, r) for c in range(32) for l in range(36)
            for r in (Role.KEY, Role.VALUE)]
    x = ObjectIndex()

    def fill():
        for i in range(0, len(keys), 256):
            b = keys[i:i + 256]
            k = len(b)
            x.add_many(b, list(range(i, i + k)), [1] * k, [100] * k, [100] * k, [1] * k)

    best = float("inf")
    for _ in range(30):
        fill()
        for s in list(x.slots()):
            x.hide(s)
            x.free(s)
        t = time.perf_counter()
        fill()
        best = min(best, time.perf_counter() - t)
        for s in list(x.slots()):
            x.hide(s)
            x.free(s)
    return best / 9 * 1e6  # per 256-key batch


def segs72():
    return [SimpleNamespace(layer=i // 2, block_bytes=32768, block_shape=(16, 8, 128),
                            copy=(1 << 30 + (i % 20), 32768, 1, 32768, 32768)) for i in range(72)]


def tables() -> tuple[float, float]:
    segs = segs72()
    geo = _geometry(segs)
    rng = np.random.default_rng(1)
    chunks = [ChunkBlocks(bytes([c]) * 16, rng.permutation(512)[:16].tolist()) for c in range(5)]
    ci, si = np.divmod(np.arange(256) + 40, 72)
    tg = _Targets(chunks, segs, geo)
    _, direct, _, pos, _ = tg.places(ci, si)
    c2, s2, addr = ci[~direct], si[~direct], (1 << 40) + pos
    table = best_us(lambda: tg.table(c2, s2, addr, gather=True))
    g = tg.geo[s2].copy()
    g[:, 6] = addr
    ids = tg.flat[(tg.start[c2][:, None] + np.arange(16)).reshape(-1)]
    counts = tg.counts[c2]
    return table, best_us(lambda: _table_of(g, ids, counts, gather=True))


def headers() -> float:
    rows = []
    for layer in range(36):
        for r in (Role.KEY, Role.VALUE):
            row, crc = header_row(SegmentHeader(Format.RAW, BF16, 524288, 524288, 0, role=r, layer=layer))
            rows.append((np.frombuffer(row.tobytes(), np.uint8), crc))
    idx = np.tile(np.arange(72), 4)[:256]
    heads = np.stack([rows[i][0] for i in idx]).copy()
    pc = np.random.default_rng(0).integers(0, 2 ** 32, 256, dtype=np.uint32)
    hv = heads.view([("x", "V24"), ("pcrc", "<u4"), ("y", "V32"), ("hcrc", "<u4")]).reshape(256)
    hv["pcrc"] = pc
    hv["hcrc"] = header_crcs(np.array([rows[i][1] for i in idx], np.uint32), pc)
    layers, roles = idx // 2, np.array([int(Role.KEY), int(Role.VALUE)])[idx % 2]
    lengths = np.full(256, 524288 + HEADER_SIZE)
    assert _verify_headers(heads, layers, roles, lengths)[0].all()
    return best_us(lambda: _verify_headers(heads, layers, roles, lengths))


def save_columns() -> float:
    segs = segs72()
    eng = SimpleNamespace(segs=segs, seg_index={id(s): i for i, s in enumerate(segs)}, enc_classes={},
                          enc_batches={}, geometry=_geometry(segs))
    p = SimpleNamespace(_gpu_codecs=SimpleNamespace(
        encode_class=lambda engine, seg, blocks: SimpleNamespace(kind="fp8", key=(segs.index(seg), blocks))))
    rng = np.random.default_rng(1)
    chunks = [ChunkBlocks(bytes([c]) * 16, rng.permutation(512)[:16].tolist()) for c in range(32)]
    items = [(ch, s, b"k" * 36) for ch in chunks for s in segs]
    batches = [items[i:i + 256] for i in range(0, len(items), 256)]

    def run():
        for b in batches:
            SavePipeline._save_columns(p, eng, None, b)
    return best_us(run, calls=20) / len(batches)


def write_headers() -> float:
    import orbitkv_fs.gpu.engine as E

    rows, bases = [], []
    for layer in range(36):
        for r in (Role.KEY, Role.VALUE):
            row, crc = header_row(SegmentHeader(Format.RAW, BF16, 524288, 524288, 0, role=r, layer=layer))
            rows.append(np.frombuffer(row.tobytes(), np.uint8))
            bases.append(crc)
    trows, bases = np.stack(rows), np.array(bases, np.uint32)
    host = np.zeros(256 * 524800 + 8192, np.uint8)
    slots = 4096 + np.arange(256) * 524800  # multiples of 64, as arena slots are
    tid = np.tile(np.arange(72), 4)[:256]
    pcrc = np.random.default_rng(0).integers(0, 2 ** 32, 256, dtype=np.uint32)
    job, idx = E.EncodeJob.of(256), np.arange(256)
    return best_us(lambda: E._write_headers(job, host, trows, bases, tid, pcrc, slots, idx, views=False))


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    table, table_of = tables()
    res = {"tree": name, "us_per_call": {
        "ObjectIndex.add_many (steady, per 256-key batch)": add_many_steady(),
        "_Targets.table (256 pairs x 16 blocks)": table,
        "_table_of (the same rows)": table_of,
        "_verify_headers (256 headers)": headers(),
        "SavePipeline._save_columns (per 256-item batch)": save_columns(),
        "_write_headers (256 headers)": write_headers()}}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
