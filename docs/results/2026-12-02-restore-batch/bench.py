"""Microbenchmark of the restore's per-segment host work, before (one call per segment) and after (batch
operations), in one process on the same data, rounds alternating old/new. Prints and writes JSON: µs per
segment (median of the rounds) for each stage.

    python docs/results/2026-12-02-restore-batch/bench.py [--rounds 15] [--out results.json]

Stages: keys of 32 chunks x 72 segments (pack_key per segment vs segment_keys from the engine's tails);
DramTier.lease of those 2,304 keys (the per-key lease as it was vs the batch) under LRU and S3-FIFO, and
DramTier.unlease of what it leased (per entry as it was vs the batch); the
header checks of 2,304 arena segments bound for the GPU engine (peek, _verify_header and the size check
per segment, as phase 1 and _decode_gpu made them, vs _check_device_batch: one gather, _verify_headers,
a SegmentHeader per segment), with the SegmentHeader building alone; the pinned test of each source
(_arena_offset per blob vs the id set); the decode batches (_codec_batches with two lambdas per segment vs
_cuts on the header arrays); the decoded batches' results (a tuple per segment and the restore's loop over
them vs _decode_end's totals).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from types import SimpleNamespace

import msgspec
import numpy as np

from orbitkv_fs.codecs import encode_segment
from orbitkv_fs.errors import SegmentError
from orbitkv_fs.keys import key_tails, pack_key, segment_keys
from orbitkv_fs.manager.api import ChunkBlocks
from orbitkv_fs.manager.batching import Batching, _decode_bound
from orbitkv_fs.manager.restore import RestorePipeline
from orbitkv_fs.manager.verify import _header_rows_at, _verify_header, _verify_headers
from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, Role, peek_source
from orbitkv_fs.index import HIDDEN
from orbitkv_fs.tiers.dram import UNIT, DramTier

CHUNKS, LAYERS = 32, 36
NS = bytes(range(16))


class _Pipeline(RestorePipeline, Batching):
    def __init__(self, dram) -> None:
        self.dram = dram
        self._config = SimpleNamespace(storage_codec_budget=256 << 20, batch_segments=256)
        self._gpu_codecs = object()


def _lease_per_key(t: DramTier, keys):
    """DramTier.lease as it was: per key an index get, the lease counters, the policy's touch."""
    out = []
    ix = t.index
    with t.lock:
        for k in keys:
            slot = ix.get(k)
            if slot is None:
                out.append(None)
                continue
            if t.prefetched:
                t._served(slot)
            ix.leases[slot] += 1
            t.leases_active += 1
            t.leased_bytes += ix.units[slot] * UNIT
            t.policy.touch(slot)
            out.append((slot, ix.generation[slot], ix.offset[slot] * UNIT, ix.length[slot]))
    return out


def _unlease_per_entry(t: DramTier, entries) -> None:
    """DramTier.unlease as it was: per entry the checks, the counters, a hidden slot freed."""
    ix = t.index
    with t.lock:
        for slot, gen in entries:
            assert ix.generation[slot] == gen and ix.leases[slot] > 0, "lease accounting broken"
            ix.leases[slot] -= 1
            t.leases_active -= 1
            t.leased_bytes -= ix.units[slot] * UNIT
            if ix.leases[slot] == 0 and ix.state[slot] == HIDDEN:
                t._free_slot(slot)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    segs = [SimpleNamespace(layer=layer, role=role, dtype_code=3, dtype=np.dtype(np.float16), block_bytes=2048)
            for layer in range(LAYERS) for role in (Role.KEY, Role.VALUE)]
    chunks = [ChunkBlocks(i.to_bytes(16, "little"), [2 * i, 2 * i + 1]) for i in range(CHUNKS)]
    tails = key_tails((s.layer, s.role) for s in segs)
    n = CHUNKS * len(segs)
    shm = tempfile.mkdtemp(prefix="orbitkv-bench-", dir="/dev/shm")
    tiers = {pol: DramTier(64 << 20, shm_dir=shm, pin=False, policy=pol) for pol in ("lru", "s3fifo")}
    try:
        _run(args, segs, chunks, tails, n, tiers)
    finally:
        for t in tiers.values():
            t.close()
        os.rmdir(shm)


def _run(args, segs, chunks, tails, n, tiers) -> None:
    x = np.random.default_rng(0).standard_normal(2048).astype(np.float16)
    blobs = {s.layer * 3 + s.role: encode_segment(x, "fp8", role=s.role, layer=s.layer) for s in segs}
    keys = [[pack_key(NS, ch.key, s.layer, s.role) for s in segs] for ch in chunks]
    flat = [k for ks in keys for k in ks]
    spans = {}
    for t in tiers.values():
        for ks in keys:
            for s, kb in zip(segs, ks):
                b = blobs[s.layer * 3 + s.role]
                off = t.reserve(len(b))
                t.view(off, len(b))[:] = np.frombuffer(b, np.uint8)
                t.publish(kb, off, len(b), 4096, 2)
                if t is tiers["lru"]:
                    spans[kb] = (off, len(b))
    dram = tiers["lru"]
    p = _Pipeline(dram)
    views = [memoryview(dram.view(*spans[kb])) for kb in flat]
    ids = {id(v) for v in views}
    items = [(ci, seg, ch, None, v, kb) for (ci, ch), ks in zip(enumerate(chunks), keys)
             for seg, kb, v in zip(segs, ks, views[ci * len(segs):(ci + 1) * len(segs)])]

    def keys_old():
        return [[pack_key(NS, ch.key, s.layer, s.role) for s in segs] for ch in chunks]

    def keys_new():
        return [segment_keys(NS, ch.key, tails) for ch in chunks]

    def lease(pol, batch):
        t = tiers[pol]

        def run():
            got = t.lease(flat) if batch else _lease_per_key(t, flat)
            return got
        return run

    def verify_old():
        out = []
        for ci, seg, ch, _, blob, kb in items:
            want = len(ch.blocks) * seg.block_bytes
            if peek_source(blob) != (seg.dtype_code, want):
                continue
            try:
                h = _verify_header(kb, blob)
                if h.original_length != want or h.dtype != seg.dtype:
                    raise SegmentError("header changed")
            except SegmentError:
                continue
            out.append(h)
        return out

    def verify_new():
        return p._check_device_batch(chunks, segs, keys, spans)

    offs = np.asarray([spans[kb][0] for kb in flat])
    lens = np.asarray([spans[kb][1] for kb in flat])
    layer_a = np.asarray([s.layer for s in segs] * CHUNKS)
    role_a = np.asarray([int(s.role) for s in segs] * CHUNKS)

    def verify_arrays():
        return _verify_headers(_header_rows_at(dram.arena.buf, offs), layer_a, role_a, lens)

    ok, tid, templates = verify_arrays()
    pc = _header_rows_at(dram.arena.buf, offs).view(HEADER_DTYPE).reshape(-1)["payload_crc"].tolist()
    tl = tid.tolist()

    def headers_only():
        replace = msgspec.structs.replace
        return [replace(templates[t], payload_crc=c) for t, c in zip(tl, pc)]

    def pinned_old():
        return [p._arena_offset(b) is not None for b in views]

    def pinned_new():
        return [id(b) in ids for b in views]

    hs, sizes = verify_new()
    done_items = [(ci, seg, ch, h, blob) for (ci, seg, ch, _, blob, _), h in zip(items, hs)]

    def batches_old():
        return list(p._codec_batches(iter(done_items), lambda it: _decode_bound(it[3]), lambda it: it[3].original_length))

    def batches_new():
        return list(p._cuts(sizes[:, 0], sizes[:, 1]))

    errs = [None] * n

    def results_old():
        done = [(ci, seg, ch, h, err) for (ci, seg, ch, h, _), err in zip(done_items, errs)]
        segments = logical = stored = 0
        for ci, seg, ch, h, err in done:
            if err is not None:
                continue
            segments += 1
            logical += h.original_length
            stored += HEADER_SIZE + h.stored_length
        return segments, logical, stored

    def results_new():
        failed, totals = [], [0, 0, 0]
        p._decode_end(done_items, None, int(sizes[:, 1].sum()), int(sizes[:, 2].sum()), 0.0, failed, totals)
        return totals

    p._workspace_delta = lambda d: None
    p._add_per_segment = lambda *a: None
    p._gpu_codecs = SimpleNamespace(decode_finish=lambda db: (errs, None))
    assert results_old() == tuple(results_new())
    assert [len(b) for b in batches_old()] == [j - i for i, j in batches_new()]
    assert verify_old() == [h for h in verify_new()[0]]

    stages = {
        "keys (32 chunks x 72)": (keys_old, keys_new),
        "DramTier.lease, lru": (lease("lru", False), lease("lru", True)),
        "DramTier.lease, s3fifo": (lease("s3fifo", False), lease("s3fifo", True)),
        "header checks (phase 1 + _decode_gpu)": (verify_old, verify_new),
        "pinned test per source": (pinned_old, pinned_new),
        "decode batches": (batches_old, batches_new),
        "decoded results": (results_old, results_new),
    }
    times = {name: ([], []) for name in stages}
    for pol in ("lru", "s3fifo"):
        times[f"DramTier.unlease, {pol}"] = ([], [])
    extra = {"_verify_headers alone": [], "SegmentHeader per segment (replace)": []}
    for _ in range(args.rounds):
        for name, fns in stages.items():
            for which in (0, 1):
                t0 = time.perf_counter()
                got = fns[which]()
                times[name][which].append((time.perf_counter() - t0) / n * 1e6)
                if name.startswith("DramTier.lease"):
                    t = tiers["lru" if "lru" in name else "s3fifo"]
                    entries = [g[:2] for g in got]
                    t0 = time.perf_counter()
                    t.unlease(entries) if which else _unlease_per_entry(t, entries)
                    times[name.replace("lease", "unlease")][which].append((time.perf_counter() - t0) / n * 1e6)
        for name, fn in (("_verify_headers alone", verify_arrays), ("SegmentHeader per segment (replace)", headers_only)):
            t0 = time.perf_counter()
            fn()
            extra[name].append((time.perf_counter() - t0) / n * 1e6)
    rows = []
    for name, (old, new) in times.items():
        o, w = statistics.median(old), statistics.median(new)
        rows.append({"stage": name, "old_us_per_segment": round(o, 4), "new_us_per_segment": round(w, 4),
                     "speedup": round(o / w, 2) if w else None})
    for name, ts in extra.items():
        rows.append({"stage": name, "new_us_per_segment": round(statistics.median(ts), 4)})
    out = {"segments": n, "chunks": CHUNKS, "segments_per_chunk": len(segs), "rounds": args.rounds,
           "python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows}
    for r in rows:
        print(f"{r['stage']:45s} {r.get('old_us_per_segment', ''):>10} {r['new_us_per_segment']:>10} "
              f"{r.get('speedup', '')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
