"""``orbitkv-bench ssd``: SSD tier writeback and demand-read throughput next to fio, and demand-read latency
while the writeback lane is saturated.

For each record size (``--bs``, the on-disk record: record header + segment + padding) and queue depth
(``--qd``), in one run and in one directory (so on one file system):

* tier writeback: ``SsdTier.submit`` of ``--size`` bytes of records into a fresh O_DIRECT shard, then
  ``flush``; GB/s of record bytes. fio: ``--rw=write`` with the same bs, iodepth, ``--direct=1``,
  ``--ioengine=io_uring`` and size, into a fresh file in the same directory (fio preallocates it).
* tier demand read: ``SsdTier.read_many`` of every record just written (read ring at the same depth; each
  record validated: tag, key, generation, segment CRC32C; bytes copied out and handed to a consumer
  that drops them, as DRAM admission would). fio: ``--rw=read`` of the same shard file.
* latency: QD1 demand reads of 64 KiB records (p50/p99/mean), idle and while a writer thread keeps the
  lane saturated with 1 MiB records at QD32, with the tier's demand-read throttle off
  (``write_bytes_while_reading=None``) and on (the default), alternating; fio's equivalent is a QD1
  ``randread`` job next to a QD32 ``write`` job on one prefilled file.

* promotion (``--only promotion``): a Manager over host engine pages (8 layers, K and V, 512 KiB segments)
  saves ``--promotion-size`` of chunks, moves them all to the SSD tier (``flush_dram``), then a lookup
  promotes them back into DRAM (SSD read, record checks, DRAM admission, index); GB/s of segment bytes.
  Baseline in the same run, alternating: the tier's own ``read_many`` of the same records into a consumer
  that drops them.

The scratch files live in ``--dir`` or in a fresh directory of the system temporary directory.

Prints a table, or JSON with ``--json``; ``--out FILE`` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import numpy as np

from orbitkv_fs.console import HelpFormatter
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.progress import progress
from orbitkv_fs.provenance import code_identity
from orbitkv_fs.segment import HEADER_SIZE, Format, Role, SegmentHeader, build_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import MAX_RECORD, RECORD_HEADER_SIZE

NS = b"orbitkv-bench-ss"


def _size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mul in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10), ("g", 1 << 30), ("m", 1 << 20),
                        ("k", 1 << 10)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mul)
    return int(t)


def _segments(record_bytes: int, count: int) -> list[bytes]:
    """``count`` distinct raw segments whose records are exactly ``record_bytes`` on disk."""
    payload = record_bytes - RECORD_HEADER_SIZE - HEADER_SIZE
    rng = np.random.default_rng(record_bytes)
    out = []
    for _ in range(count):
        data = rng.integers(0, 256, payload, dtype=np.uint8)
        out.append(build_segment(SegmentHeader(Format.RAW, np.dtype(np.uint8), payload, payload, 0), data))
    return out


def _key(i: int, tag: str) -> ObjectKey:
    return ObjectKey(NS, chunk_key(f"{tag}{i}"), 0, Role.OPAQUE)


def _config(path: str, capacity: int, qd: int, bs: int) -> SsdConfig:
    return SsdConfig(paths=(path,), capacity=capacity, backend="uring", write_queue_depth=qd,
                     read_queue_depth=qd, max_pending_bytes=max(MAX_RECORD, 2 * qd * bs))


def _tier(path: str, capacity: int, qd: int, bs: int) -> SsdTier:
    return SsdTier(_config(path, capacity, qd, bs))


def _submit_all(t: SsdTier, keys: Sequence[ObjectKey], segs: Sequence[bytes]) -> None:
    for i, k in enumerate(keys):
        # The benchmark wants throughput, not drops: each submit waits for room in the lane.
        if not t.submit(k, segs[i % len(segs)], timeout=60.0):
            raise RuntimeError("the SSD lane made no room in 60 s")


def _fio(args: list[str]) -> dict[str, Any]:
    p = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, check=True)
    return json.loads(p.stdout[p.stdout.index("{"):])


def _fio_bw(job: str, path: str, size: int, bs: int, qd: int) -> float:
    d = _fio([f"--name={job}", f"--filename={path}", f"--size={size}", f"--bs={bs}", f"--iodepth={qd}",
              f"--rw={job}", "--direct=1", "--ioengine=io_uring", "--end_fsync=0"])
    return d["jobs"][0]["write" if job == "write" else "read"]["bw_bytes"] / 1e9


def throughput(d: str, bs: int, qd: int, size: int, with_fio: bool) -> dict[str, Any]:
    n = max(1, size // bs)
    segs = _segments(bs, 16)
    keys = [_key(i, f"t{bs}-{qd}-") for i in range(n)]
    path = os.path.join(d, "bench-ssd.okv")
    row: dict[str, Any] = {"record_bytes": bs, "qd": qd, "records": n}
    with _tier(path, n * bs + (64 << 20), qd, bs) as t:
        t0 = time.perf_counter()
        _submit_all(t, keys, segs)
        t.flush()
        dt = time.perf_counter() - t0
        s = t.snapshot()
        assert s.write_errors_total == 0 and s.objects == n, s
        row["tier_write_GBps"] = n * bs / dt / 1e9
        got = [0]

        def consume(i: int, seg: bytes) -> None:  # a consumer that moves each segment on (as DRAM does)
            got[0] += 1

        t0 = time.perf_counter()
        t.read_many(keys, sink=consume)
        dt = time.perf_counter() - t0
        assert got[0] == n
        row["tier_read_GBps"] = n * bs / dt / 1e9
    if with_fio:
        # fio reads the very file the tier wrote (same extents), and writes a fresh file that it
        # preallocates itself, as the tier's shard was.
        row["fio_read_GBps"] = _fio_bw("read", path, n * bs, bs, qd)
        os.unlink(path)
        row["fio_write_GBps"] = _fio_bw("write", path, n * bs, bs, qd)
        row["write_vs_fio"] = row["tier_write_GBps"] / row["fio_write_GBps"]
        row["read_vs_fio"] = row["tier_read_GBps"] / row["fio_read_GBps"]
    os.unlink(path)
    return row


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every GB/s figure over repeated runs; ratios of the medians; the runs kept as they were."""
    row = dict(runs[0])
    for k in ("tier_write_GBps", "tier_read_GBps", "fio_write_GBps", "fio_read_GBps"):
        if k in row:
            row[k] = float(np.median([r[k] for r in runs]))
    if "fio_write_GBps" in row:
        row["write_vs_fio"] = row["tier_write_GBps"] / row["fio_write_GBps"]
        row["read_vs_fio"] = row["tier_read_GBps"] / row["fio_read_GBps"]
    if len(runs) > 1:
        row["runs"] = runs
    return row


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def _saturated(path: str, fill: int, saturate: int, qd: int, samples: int, throttle: bool) -> dict[str, Any]:
    """One tier, fresh shard: fill it with 64 KiB records, sample QD1 reads idle, then while a writer
    thread keeps the lane saturated with 1 MiB records."""
    rbs, wbs = 64 << 10, 1 << 20
    nread, nwrite = fill // rbs, saturate // wbs
    rkeys = [_key(i, "lat-r") for i in range(nread)]
    wkeys = [_key(i, "lat-w") for i in range(nwrite)]
    rnd = random.Random(1)
    cfg = _config(path, nread * rbs + nwrite * wbs + (64 << 20), qd, wbs)
    if not throttle:
        cfg = dataclasses.replace(cfg, write_bytes_while_reading=None)
    with SsdTier(cfg) as t:
        _submit_all(t, rkeys, _segments(rbs, 16))
        t.flush()

        def sample(stop: threading.Event | None) -> list[float]:
            lat = []
            while len(lat) < samples and not (stop is not None and stop.is_set()):
                k = rkeys[rnd.randrange(nread)]
                t0 = time.perf_counter()
                assert t.read(k) is not None
                lat.append(time.perf_counter() - t0)
            return lat

        idle = sample(None)
        done = threading.Event()

        def writer() -> None:
            _submit_all(t, wkeys, _segments(wbs, 8))
            t.flush()
            done.set()

        t0 = time.perf_counter()
        th = threading.Thread(target=writer)
        th.start()
        try:
            busy = sample(done)
            # The writeback rate while reads were being sampled, then the whole write.
            sampled_dt, sampled_bytes = time.perf_counter() - t0, t.snapshot().write_bytes_total
        finally:
            th.join()
        wdt = time.perf_counter() - t0
        s = t.snapshot()
    os.unlink(path)
    return {"throttled": throttle, "idle_read_p50_us": _pct(idle, 50) * 1e6, "idle_read_p99_us": _pct(idle, 99) * 1e6,
            "saturated_read_p50_us": _pct(busy, 50) * 1e6, "saturated_read_p99_us": _pct(busy, 99) * 1e6,
            "saturated_read_mean_us": float(np.mean(busy)) * 1e6 if busy else float("nan"),
            "saturated_samples": len(busy), "write_GBps_while_sampling": sampled_bytes / sampled_dt / 1e9,
            "write_GBps": nwrite * wbs / wdt / 1e9, "write_held_for_reads_total": s.write_held_for_reads_total}


def latency(d: str, fill: int, saturate: int, qd: int, samples: int, with_fio: bool,
            repeat: int = 1) -> dict[str, Any]:
    """Demand-read latency with the writeback lane saturated, the tier without its demand-read throttle
    (``write_bytes_while_reading=None``) and with it (the default), alternating, ``repeat`` times each;
    then fio's reader next to fio's writer on one file."""
    rbs, wbs = 64 << 10, 1 << 20
    path = os.path.join(d, "bench-ssd-lat.okv")
    out: dict[str, Any] = {"read_record_bytes": rbs, "write_record_bytes": wbs, "write_qd": qd, "runs": []}
    for _ in range(max(1, repeat)):
        for throttle in (False, True):
            out["runs"].append(_saturated(path, fill, saturate, qd, samples, throttle))
    for throttle, label in ((False, "unthrottled"), (True, "throttled")):
        rows = [r for r in out["runs"] if r["throttled"] is throttle]
        for k in ("idle_read_p50_us", "idle_read_p99_us", "saturated_read_p50_us", "saturated_read_p99_us",
                  "saturated_read_mean_us", "write_GBps_while_sampling", "write_GBps"):
            out[f"{label}_{k}"] = float(np.median([r[k] for r in rows]))
    if with_fio:
        fpath = os.path.join(d, "bench-fio-lat.dat")
        common = [f"--filename={fpath}", "--direct=1", "--ioengine=io_uring", f"--size={fill + saturate}"]
        _fio(["--name=prefill", "--rw=write", "--bs=1m", "--iodepth=32", *common])
        runtime = f"--runtime={max(1, int(round(saturate / 0.5e9)))}"
        res = _fio(["--name=writer", "--rw=write", "--bs=1m", f"--iodepth={qd}", "--time_based", runtime, *common,
                    "--name=reader", "--rw=randread", f"--bs={rbs}", "--iodepth=1", f"--size={fill}",
                    f"--filename={fpath}", "--direct=1", "--ioengine=io_uring", "--time_based", runtime])
        reader = next(j for j in res["jobs"] if j["jobname"] == "reader")
        pct = reader["read"]["clat_ns"]["percentile"]
        out["fio_saturated_read_p50_us"] = pct["50.000000"] / 1e3
        out["fio_saturated_read_p99_us"] = pct["99.000000"] / 1e3
        out["fio_saturated_read_mean_us"] = reader["read"]["clat_ns"]["mean"] / 1e3
        out["fio_saturated_write_GBps"] = next(j for j in res["jobs"] if j["jobname"] == "writer")["write"]["bw_bytes"] / 1e9
        os.unlink(fpath)
    return out


def promotion(d: str, size: int, repeat: int) -> dict[str, Any]:
    """Lookup promotion of ``size`` logical bytes from the SSD tier into DRAM against the tier's raw reads
    of the same records, alternating ``repeat`` times; medians."""
    from orbitkv_fs.geometry import EngineRegistration
    from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
    from orbitkv_fs.pages import host_engine_pages

    layers, block_tokens, heads, head_dim, chunk_blocks = 8, 16, 8, 128, 16  # 512 KiB segments
    seg_bytes = chunk_blocks * block_tokens * heads * head_dim * 2
    nchunks = max(1, size // (seg_bytes * 2 * layers))
    blocks = nchunks * chunk_blocks
    pages, descs = host_engine_pages(num_layers=layers, num_blocks=blocks, block_size=block_tokens, num_heads=heads,
                                     head_dim=head_dim, layout="separate")
    rng = np.random.default_rng(0)
    for name in pages.tensors:
        a = pages.array(name).view(np.uint16)
        a[...] = rng.integers(0, 1 << 16, a.shape, dtype=np.uint16)
    reg = EngineRegistration(model="bench-ssd", num_layers=layers, layer_start=0, layer_end=layers,
                             block_size=block_tokens, num_heads=heads, head_dim=head_dim, dtype="bfloat16",
                             tensors=descs)
    logical = nchunks * 2 * layers * seg_bytes
    shard = os.path.join(d, "promotion.shard")
    tier = SsdTier(SsdConfig(paths=(shard,), capacity=2 * logical + (64 << 20)))
    row: dict[str, Any] = {"segments": nchunks * 2 * layers, "segment_bytes": seg_bytes, "logical_bytes": logical}
    tier_s, promote_s = [], []
    try:
        with Manager(ManagerConfig(pool_size=logical + (64 << 20), device="cpu", ssd_prefetch_chunks=0),
                     lower_tier=tier) as m:
            e = m.register_engine(reg)
            chunks = [ChunkBlocks(chunk_key(f"promote-{i}"), list(range(i * chunk_blocks, (i + 1) * chunk_blocks)))
                      for i in range(nchunks)]
            m.save(e.engine_id, chunks)
            m.flush_dram()
            keys = [k for k, _ in tier.iter_objects()]
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                tier.read_many(keys, sink=lambda i, seg: None)
                tier_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                lk = m.lookup(e.engine_id, [c.key for c in chunks])
                promote_s.append(time.perf_counter() - t0)
                if lk.count != nchunks:
                    raise RuntimeError(f"promotion found {lk.count} of {nchunks} chunks")
                m.release(lk.lease_id)
                m.flush_dram()  # back to SSD-only (the records are there: nothing is written again)
    finally:
        pages.close()
        tier.close()
        if os.path.exists(shard):
            os.unlink(shard)
    row["tier_read_GBps"] = logical / float(np.median(tier_s)) / 1e9
    row["promotion_GBps"] = logical / float(np.median(promote_s)) / 1e9
    row["promotion_vs_tier_read"] = row["promotion_GBps"] / row["tier_read_GBps"]
    row["tier_read_s"], row["promotion_s"] = tier_s, promote_s
    return row


def _table(doc: dict[str, Any]) -> str:
    lines = ["record  QD  tier write  fio write  ratio   tier read  fio read  ratio   (GB/s)"]
    for r in doc.get("throughput", []):
        lines.append(f"{r['record_bytes'] >> 10:>5}K {r['qd']:>3}  {r['tier_write_GBps']:>10.3f} "
                     f"{r.get('fio_write_GBps', float('nan')):>10.3f} {r.get('write_vs_fio', float('nan')):>6.2f}  "
                     f"{r['tier_read_GBps']:>10.3f} {r.get('fio_read_GBps', float('nan')):>9.3f} "
                     f"{r.get('read_vs_fio', float('nan')):>6.2f}")
    lat = doc.get("latency")
    if lat:
        lines.append("64K QD1 demand read, writeback lane saturated (medians over runs), us:")
        for label in ("unthrottled", "throttled"):
            lines.append(f"  tier {label:<11}: idle p50 {lat[label + '_idle_read_p50_us']:.0f}; saturated p50 "
                         f"{lat[label + '_saturated_read_p50_us']:.0f} p99 {lat[label + '_saturated_read_p99_us']:.0f} "
                         f"mean {lat[label + '_saturated_read_mean_us']:.0f}; writeback "
                         f"{lat[label + '_write_GBps_while_sampling']:.3f} GB/s while sampling")
        if "fio_saturated_read_p50_us" in lat:
            lines.append(f"  fio reader next to fio writer: p50 {lat['fio_saturated_read_p50_us']:.0f} "
                         f"p99 {lat['fio_saturated_read_p99_us']:.0f} mean {lat['fio_saturated_read_mean_us']:.0f}")
    pr = doc.get("promotion")
    if pr:
        lines.append(f"lookup promotion of {pr['logical_bytes'] >> 20} MiB ({pr['segments']} segments of "
                     f"{pr['segment_bytes'] >> 10} KiB): {pr['promotion_GBps']:.3f} GB/s; the tier's reads of the "
                     f"same records {pr['tier_read_GBps']:.3f} GB/s; ratio {pr['promotion_vs_tier_read']:.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench ssd", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the file system to measure (default: a fresh "
                   "directory in the system temporary directory, removed at the end)")
    p.add_argument("--bs", nargs="+", default=["1m", "64k"], help="record sizes (default 1m 64k)")
    p.add_argument("--qd", nargs="+", type=int, default=[8, 32], help="queue depths (default 8 32)")
    p.add_argument("--size", default="1g", help="bytes written per throughput point (default 1g)")
    p.add_argument("--latency-fill", default="256m", help="bytes of 64 KiB records read in the latency test")
    p.add_argument("--latency-saturate", default="2g", help="bytes of 1 MiB records written while sampling")
    p.add_argument("--latency-samples", type=int, default=2000, help="QD1 reads sampled per latency figure")
    p.add_argument("--no-fio", action="store_true", help="skip the fio baseline")
    p.add_argument("--no-latency", action="store_true", help="same as --only throughput")
    p.add_argument("--only", choices=("throughput", "latency", "promotion"),
                   help="run only this part (default: all three)")
    p.add_argument("--promotion-size", default="256m", help="logical bytes the promotion part moves (default 256m)")
    p.add_argument("--latency-repeat", type=int, default=1,
                   help="run the saturated-latency test N times per setting, unthrottled and throttled alternating")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each throughput point N times, tier and fio alternating; report medians "
                        "(for noisy hosts)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", help="also write the JSON here (default: print only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_throughput = args.only in (None, "throughput")
    run_latency = args.only == "latency" or (args.only is None and not args.no_latency)
    run_promotion = args.only in (None, "promotion")
    with_fio = not args.no_fio and (run_throughput or run_latency)
    if with_fio and shutil.which("fio") is None:
        print("orbitkv-bench ssd: fio not found (apt-get install fio, or --no-fio)", file=sys.stderr)
        return 2
    # Outside the working tree by default: a killed run leaves its scratch shard (up to --size) in the
    # system temporary directory, not in the repository.
    d = args.dir or tempfile.mkdtemp(prefix="orbitkv-bench-ssd-")
    os.makedirs(d, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "orbitkv-bench ssd " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "loadavg_start": os.getloadavg()},
        "code": code_identity(),
        "fio": subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() if with_fio else None,
        "filesystem": subprocess.run(["df", "-T", d], capture_output=True, text=True).stdout.splitlines()[-1].split()[1],
    }
    points = len(args.bs) * len(args.qd) * max(1, args.repeat) if run_throughput else 0
    bar = progress(points + run_latency + run_promotion, "ssd", "part")
    try:
        if run_throughput:
            doc["throughput"] = []
            for bs in map(_size, args.bs):
                for qd in args.qd:
                    runs = []
                    for _ in range(max(1, args.repeat)):
                        runs.append(throughput(d, bs, qd, _size(args.size), with_fio))
                        bar.update()
                    doc["throughput"].append(_median_row(runs))
        if run_latency:
            doc["latency"] = latency(d, _size(args.latency_fill), _size(args.latency_saturate), 32,
                                     args.latency_samples, with_fio, args.latency_repeat)
            bar.update()
        if run_promotion:
            doc["promotion"] = promotion(d, _size(args.promotion_size), args.repeat)
            bar.update()
    finally:
        bar.close()
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)
    doc["host"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(doc, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text if args.json else _table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
