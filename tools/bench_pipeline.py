"""``orbitkv-bench pipeline``: save/restore through the Manager's whole pipeline, and its data plane.

Figures (each next to its baseline, measured in the same run):

* ``throughput``: logical GB/s (source bytes per second) of ``Manager.save`` and ``Manager.restore`` for
  each codec at 64 KiB - 4 MiB segments, over host engine pages in shared memory, next to a plain copy of
  the same bytes (``numpy.copyto`` of the engine pages into a preallocated buffer); and the host CPU time
  per segment of each call and of each pipeline stage (``ManagerStats.host_cpu_seconds``).
* ``dataplane``: p50/p99 round trip of an empty lookup and of a 64-chunk lookup against a real
  ``orbitkv-cache-manager`` process over ipc://, next to a ping and a bare libzmq REQ/ROUTER echo;
  save and restore of 1 MiB segments remote vs embedded.
* ``index``: bytes of Python heap per cached segment at 1 million segments (tracemalloc), for the
  index alone and with each eviction policy.

``--device gpu`` runs the same pipeline as production does: engine pages in another process's GPU memory
imported through CUDA IPC, the arena pinned, the GPU codec engine; the baselines are that engine's own
pinned device-to-host and host-to-device copies of the same pages.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Callable, Sequence

import ml_dtypes
import numpy as np

from orbitkv_fs.console import HelpFormatter
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.index import ObjectIndex
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.provenance import code_identity
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.pages import host_engine_pages
from orbitkv_fs.progress import progress
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.eviction import make_policy

# Geometry of the throughput runs: 8 layers by default (``--layers``; TurboQuant leaves the first and last
# two exact, as in production), 8 KV heads x 128 x 16 tokens of BF16: one block of one layer and role is 32 KiB.
LAYERS, HEADS, HEAD_DIM, BLOCK = 8, 8, 128, 16
BLOCK_BYTES = HEADS * HEAD_DIM * BLOCK * 2
SEGMENT_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
BATCH_SEGMENTS = ManagerConfig().batch_segments


def _engine(num_blocks: int, num_layers: int = LAYERS, seed: int = 0):
    pages, descs = host_engine_pages(num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK,
                                     num_heads=HEADS, head_dim=HEAD_DIM)
    rng = np.random.default_rng(seed)
    for name in pages.tensors:
        a = pages.array(name)
        a[...] = rng.standard_normal(a.shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    reg = EngineRegistration(model="bench", num_layers=num_layers, layer_start=0, layer_end=num_layers,
                             block_size=BLOCK, num_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16", tensors=descs)
    return pages, reg


def _memcpy_gbs(pages, repeat: int) -> float:
    srcs = [pages.array(n) for n in pages.tensors]
    dsts = [np.empty_like(s) for s in srcs]
    total = sum(s.nbytes for s in srcs)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)
        best = min(best, time.perf_counter() - t)
    return total / best / 1e9


def _host_baseline(pages, repeat: int) -> dict:
    gbs = _memcpy_gbs(pages, repeat)
    return {"save_baseline_gbs": gbs, "restore_baseline_gbs": gbs}


def bench_throughput(codecs: list[str], num_blocks: int, repeat: int, device: str,
                     block_order: str = "contiguous", layers: int = LAYERS,
                     segment_sizes: Sequence[int] = SEGMENT_SIZES, batch_segments: int = BATCH_SEGMENTS,
                     profiles: "dict[str, cProfile.Profile] | None" = None) -> dict:
    """Host engine pages in shared memory; baseline ``numpy.copyto`` of the same pages."""
    pages, reg = _engine(num_blocks, layers)
    try:
        return _throughput(codecs, reg, num_blocks, repeat, device, lambda: _host_baseline(pages, repeat), block_order,
                           pages="host pages in /dev/shm", baseline_name="numpy.copyto of the same pages",
                           segment_sizes=segment_sizes, batch_segments=batch_segments, profiles=profiles)
    finally:
        pages.close()


def _gpu_engine_process(nbytes: int, tensor_bytes: int, repeat: int, cmd, reply) -> None:
    """The engine: one cudaMalloc of all KV tensors (BF16 from a normal distribution), exported by CUDA IPC;
    on request, the pinned-copy baseline of its own pages (one copy per tensor, as the Manager does per
    batch), timed with CUDA events, best of ``repeat``."""
    import cupy

    mem = cupy.cuda.Memory(nbytes)
    bits = cupy.random.default_rng(0).standard_normal(nbytes // 2, dtype=cupy.float32).view(cupy.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)  # round to nearest even
    cupy.ndarray((nbytes // 2,), cupy.uint16, memptr=cupy.cuda.MemoryPointer(mem, 0))[...] = bf16
    del bits, bf16
    cupy.cuda.runtime.deviceSynchronize()
    reply.put(bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)))
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    stream = cupy.cuda.Stream(non_blocking=True)

    def best(kind: int) -> float:
        t_best = float("inf")
        for _ in range(repeat + 1):  # the first one warms the copy engines
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for off in range(0, nbytes, tensor_bytes):
                dst, src = (pinned.ptr + off, mem.ptr + off) if kind == 2 else (mem.ptr + off, pinned.ptr + off)
                cupy.cuda.runtime.memcpyAsync(dst, src, tensor_bytes, kind, stream.ptr)
            end.record(stream)
            end.synchronize()
            t_best = min(t_best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return nbytes / t_best / 1e9

    while cmd.get() == "memcpy":
        reply.put({"save_baseline_gbs": best(2), "restore_baseline_gbs": best(1)})


def _reply(q, proc, timeout: float = 300.0):
    """The engine's next answer; a dead engine process is an error at once, not a wait."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the engine process exited ({proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise


def bench_throughput_gpu(codecs: list[str], num_blocks: int, repeat: int, block_order: str = "contiguous",
                         layers: int = LAYERS, segment_sizes: Sequence[int] = SEGMENT_SIZES,
                         codec_budget: int = 64 << 20, batch_segments: int = BATCH_SEGMENTS,
                         profiles: "dict[str, cProfile.Profile] | None" = None) -> dict:
    """Engine pages in another process's GPU memory (CUDA IPC), as in production; baselines: that engine's
    pinned device-to-host (save) and host-to-device (restore) copies of the same pages."""
    import multiprocessing as mp

    from orbitkv_fs.geometry import CudaIpcHandle, TensorDesc

    tensor_bytes = num_blocks * BLOCK_BYTES
    nbytes = 2 * layers * tensor_bytes
    ctx = mp.get_context("spawn")
    cmd, reply = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_gpu_engine_process, args=(nbytes, tensor_bytes, repeat, cmd, reply), daemon=True)
    proc.start()
    try:
        handle = _reply(reply, proc)
        strides = [BLOCK * HEADS * HEAD_DIM, HEADS * HEAD_DIM, HEAD_DIM, 1]
        descs = [TensorDesc(layer=l, role=role, layout="separate", shape=[num_blocks, BLOCK, HEADS, HEAD_DIM],
                            strides=strides, dtype="bfloat16",
                            handle=CudaIpcHandle(handle, (2 * l + r) * tensor_bytes, 0, nbytes))
                 for l in range(layers) for r, role in enumerate(("key", "value"))]
        reg = EngineRegistration(model="bench", num_layers=layers, layer_start=0, layer_end=layers, block_size=BLOCK,
                                 num_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16", tensors=descs)

        def baseline() -> dict:
            cmd.put("memcpy")
            return _reply(reply, proc)

        return _throughput(codecs, reg, num_blocks, repeat, "auto", baseline, block_order,
                           pages="GPU pages of an engine process, imported through CUDA IPC",
                           baseline_name="the engine's cudaMemcpyAsync of the same pages to/from pinned host memory "
                                    "(device-to-host for save, host-to-device for restore)",
                           segment_sizes=segment_sizes, codec_budget=codec_budget, round_robin=True,
                           batch_segments=batch_segments, profiles=profiles)
    finally:
        cmd.put("stop")
        proc.join(30)


def _host_probe_us() -> float:
    """Microseconds of a fixed host workload (the dict, list and small numpy work a batch's host code does),
    best of five: the host's speed right before a call. The lent GPU host (a KVM guest) runs a core at one
    speed or about 1.65x slower for seconds at a time, whatever the core (docs/results/2026-12-03-host-speed),
    and a host-bound call is slower by as much: each call is timed next to a probe of its own."""
    keys = [i.to_bytes(8, "little") for i in range(2048)]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        index = {k: i for i, k in enumerate(keys)}
        rows = [index[k] for k in keys]
        a = np.asarray(rows, dtype=np.int64)
        for _ in range(40):
            a = (a * 3 + 1) & 0xFFFF
            np.unique(a[:256], return_inverse=True)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _call_record(rep: int, save_s: float, restore_s: float, save_cpu: float, restore_cpu: float,
                 save_probe: float, restore_probe: float, w0: dict[str, float], w1: dict[str, float],
                 w2: dict[str, float]) -> dict:
    """One repeat's save and restore of a codec: seconds, the host probe taken right before each, and the
    host's own work (thread CPU less waits on the GPU) in microseconds per call."""
    return {"repeat": rep, "save_s": save_s, "restore_s": restore_s, "save_probe_us": save_probe,
            "restore_probe_us": restore_probe,
            "save_host_us": (save_cpu - (w1.get("save", 0.0) - w0.get("save", 0.0))) * 1e6,
            "restore_host_us": (restore_cpu - (w2.get("restore", 0.0) - w1.get("restore", 0.0))) * 1e6}


def _throughput(codecs: list[str], reg: EngineRegistration, num_blocks: int, repeat: int, device: str,
                baseline: Callable[[], dict], block_order: str, *, pages: str, baseline_name: str,
                segment_sizes: Sequence[int] = SEGMENT_SIZES, codec_budget: int = 64 << 20,
                round_robin: bool = False, batch_segments: int = BATCH_SEGMENTS,
                profiles: "dict[str, cProfile.Profile] | None" = None) -> dict:
    """The save / restore figures. ``profiles`` ("save", "restore"): profilers enabled around those calls in the
    repeats after the first (the steady state the host figures count), nothing else."""
    layers = reg.num_layers
    prof_save, prof_restore = (profiles["save"], profiles["restore"]) if profiles else (None, None)
    out: dict = {"geometry": {"layers": layers, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block_tokens": BLOCK,
                              "dtype": "bfloat16", "blocks": num_blocks,
                              "logical_bytes_per_run": num_blocks * BLOCK_BYTES * layers * 2,
                              "block_order": block_order, "storage_codec_budget": codec_budget,
                              "batch_segments": batch_segments},
                 "pages": pages, "baseline": baseline_name, "runs": []}
    # Engines hand out blocks from a free list: after a while a chunk's blocks are anywhere. "shuffled"
    # gives every chunk random block ids (the gather/scatter path); "contiguous" consecutive ones.
    order = np.arange(num_blocks)
    if block_order == "shuffled":
        np.random.default_rng(1).shuffle(order)
    # Round robin: each repeat runs every codec once, so that each codec's best-of figure samples the same
    # stretches of a shared machine (its host's speed drifts for seconds at a time) and the 'vs none'
    # ratios compare like with like. It keeps a Manager (and arena) per codec alive at once: the GPU path
    # only; the host path keeps one Manager at a time (its arena lives in /dev/shm).
    groups = [list(codecs)] if round_robin else [[c] for c in codecs]
    runs: dict[tuple[str, int], dict] = {}
    bar = progress(len(codecs) * len(segment_sizes) * repeat, "pipeline throughput", "run")
    for group in groups:
        with contextlib.ExitStack() as stack:
            ms = {}
            for codec in group:
                m = stack.enter_context(Manager(ManagerConfig(
                    pool_size=2 * num_blocks * BLOCK_BYTES * layers * 2 + (64 << 20), storage_codec=codec,
                    storage_codec_budget=codec_budget, device=device, batch_segments=batch_segments)))
                ms[codec] = (m, m.register_engine(reg))
            # As orbitkv-cache-manager does once it serves: full collections then skip the start-up heap
            # (modules, cupy, the Managers), which they would otherwise rescan every few calls (35-40 ms).
            gc.collect()
            gc.freeze()
            for seg in segment_sizes:
                per = seg // BLOCK_BYTES
                chunks = {codec: [ChunkBlocks(chunk_key(f"{codec}-{seg}-{i}"), order[i * per:(i + 1) * per].tolist())
                                  for i in range(num_blocks // per)] for codec in group}
                base = baseline()  # right next to these figures
                calls: dict[str, list[dict]] = {codec: [] for codec in group}
                best = {codec: [float("inf"), float("inf"), 0, 0] for codec in group}  # save s, restore s, bytes
                cpu = {codec: [0.0, 0.0] for codec in group}  # this thread's CPU seconds in save, restore
                stages = {codec: _stage_cpu(ms[codec][0]) for codec in group}
                waits = {codec: _gpu_waits(ms[codec][0]) for codec in group}
                for rep in range(repeat):
                    if rep == 1:  # host figures from the repeats after the first (one-time allocations, warm-up)
                        for codec in group:
                            cpu[codec] = [0.0, 0.0]
                            stages[codec] = _stage_cpu(ms[codec][0])
                            waits[codec] = _gpu_waits(ms[codec][0])
                    for codec in group:
                        m, e = ms[codec]
                        b = best[codec]
                        m.invalidate(all=True)
                        steady = rep >= 1 and prof_save is not None
                        probe_save, w0 = _host_probe_us(), _gpu_waits(m)
                        c0 = time.thread_time()
                        if steady:
                            prof_save.enable()
                        r = m.save(e.engine_id, chunks[codec])
                        if steady:
                            prof_save.disable()
                        c1 = time.thread_time()
                        b[0], b[2], b[3] = min(b[0], r.seconds), r.stored_bytes, r.logical_bytes
                        probe_restore, w1 = _host_probe_us(), _gpu_waits(m)
                        c2 = time.thread_time()
                        if steady:
                            prof_restore.enable()
                        rr = m.restore(e.engine_id, chunks[codec])
                        if steady:
                            prof_restore.disable()
                        c3 = time.thread_time()
                        assert all(rr.restored), rr.misses
                        b[1] = min(b[1], rr.seconds)
                        cpu[codec][0] += c1 - c0
                        cpu[codec][1] += c3 - c2
                        calls[codec].append(_call_record(rep, r.seconds, rr.seconds, c1 - c0, c3 - c2, probe_save,
                                                         probe_restore, w0, w1, _gpu_waits(m)))
                        bar.update()
                for codec in group:
                    save_s, restore_s, stored, logical = best[codec]
                    nseg = len(chunks[codec]) * layers * 2
                    runs_counted = max(repeat - 1, 1)
                    wait = _gpu_waits(ms[codec][0])
                    counted = [c for c in calls[codec] if c["repeat"] >= 1] or calls[codec]
                    probes = [p for c in counted for p in (c["save_probe_us"], c["restore_probe_us"])]
                    run = {"codec": codec, "segment_bytes": seg, "segments": nseg,
                           "save_cpu_us_per_segment": cpu[codec][0] / (runs_counted * nseg) * 1e6,
                           "restore_cpu_us_per_segment": cpu[codec][1] / (runs_counted * nseg) * 1e6,
                           "save_wait_us_per_segment": (wait.get("save", 0.0) - waits[codec].get("save", 0.0))
                           / (runs_counted * nseg) * 1e6,
                           "restore_wait_us_per_segment": (wait.get("restore", 0.0) - waits[codec].get("restore", 0.0))
                           / (runs_counted * nseg) * 1e6,
                           "stage_cpu_us_per_segment": _stage_delta(stages[codec], _stage_cpu(ms[codec][0])),
                           "logical_bytes": logical, "stored_bytes": stored,
                           "save_gbs": logical / save_s / 1e9, "restore_gbs": logical / restore_s / 1e9, **base,
                           "host_probe_us": statistics.median(probes),
                           "host_probe_us_range": [min(probes), max(probes)],
                           "calls": calls[codec],
                           "raw_segments": dict(ms[codec][0].stats().raw_segments)}
                    run["save_vs_baseline"] = run["save_gbs"] / base["save_baseline_gbs"]
                    run["restore_vs_baseline"] = run["restore_gbs"] / base["restore_baseline_gbs"]
                    runs[(codec, seg)] = run
                    bar.write(f"  {codec:>13} {seg >> 10:>5} KiB  save {run['save_gbs']:.3f} GB/s  "
                              f"restore {run['restore_gbs']:.3f} GB/s  (baseline {base['save_baseline_gbs']:.2f} / "
                              f"{base['restore_baseline_gbs']:.2f})  stored/logical {stored / logical:.3f}")
            gc.unfreeze()  # these Managers' cycles may be collected now
    bar.close()
    out["runs"] = [runs[(codec, seg)] for codec in codecs for seg in segment_sizes]
    out["round_robin"] = round_robin
    for r in out["runs"]:  # the codec targets are relative to none at the same segment size
        none = next((x for x in out["runs"] if x["codec"] == "none" and x["segment_bytes"] == r["segment_bytes"]), None)
        if none:
            r["save_vs_none"] = r["save_gbs"] / none["save_gbs"]
            r["restore_vs_none"] = r["restore_gbs"] / none["restore_gbs"]
        # The most any implementation of the codec can reach on this link: its stored bytes moved at the
        # baseline copy's rate, with encode, decode and host work free. A target above it is out of reach.
        for op in ("save", "restore"):
            r[f"{op}_bound_gbs"] = r[f"{op}_baseline_gbs"] * r["logical_bytes"] / r["stored_bytes"]
            if none:
                r[f"{op}_bound_vs_none"] = r[f"{op}_bound_gbs"] / none[f"{op}_gbs"]
    return out


def _gpu_waits(m: Manager) -> dict[str, float]:
    """Seconds the host has waited on each GPU worker's streams (empty without the GPU engine)."""
    return dict(getattr(m.stats(), "gpu_wait_seconds", {}))


def _stage_cpu(m: Manager) -> dict[str, tuple[float, int]]:
    """The Manager's host CPU seconds and segments per pipeline stage (none before the stages were counted)."""
    s = m.stats()
    seconds, segments = getattr(s, "host_cpu_seconds", {}), getattr(s, "host_cpu_segments", {})
    return {k: (seconds[k], segments.get(k, 0)) for k in seconds}


def _stage_delta(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Host CPU microseconds per segment of each stage between two :func:`_stage_cpu` snapshots; ``save_other``
    and ``restore_other`` are what the whole request spent outside the named stages (planning, keys, counting)."""
    out: dict[str, float] = {}
    for k, (s, n) in after.items():
        s0, n0 = before.get(k, (0.0, 0))
        if n > n0:
            out[k] = (s - s0) / (n - n0) * 1e6
    for op in ("save", "restore"):
        if op in out:
            out[f"{op}_other"] = out[op] - sum(v for k, v in out.items() if k.startswith(op + "_"))
    return out


def _pcts(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_us": s[len(s) // 2] * 1e6, "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
            "n": len(s)}


def _time_calls(fn, n: int, desc: str = "calls") -> list[float]:
    out = []
    with progress(n, desc, "call") as bar:
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
            bar.update()
    return out


_ECHO_SERVER = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER)
s.bind(sys.argv[1])
while True:
    s.send_multipart(s.recv_multipart())
"""


def _libzmq_echo(endpoint: str, n: int) -> dict:
    """Round trips of a 64-key lookup's request size (1.2 kB) through libzmq REQ -> ROUTER echo in
    another process: the floor of the data plane's previous transport on this host."""
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, endpoint])
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 60_000)
        s.connect(endpoint)
        msg = bytes(1200)

        def rt() -> None:
            s.send(msg)
            s.recv()

        _time_calls(rt, 200)
        out = _pcts(_time_calls(rt, n))
        s.close(0)
        return out
    finally:
        ctx.term()
        proc.terminate()
        proc.wait(30)


def bench_dataplane(n: int) -> dict:
    from orbitkv_fs.dataplane import RemoteClient
    from orbitkv_fs.errors import OrbitKVError

    tmp = tempfile.mkdtemp(prefix="orbitkv-bench-")
    endpoint = f"ipc://{tmp}/dp.sock"
    proc = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "512mb", "--device", "cpu",
                             "--data-plane", endpoint, "--http-addr", "127.0.0.1:0", "--log-level", "WARNING"])
    per = (1 << 20) // BLOCK_BYTES  # 1 MiB segments
    pages, reg = _engine(per * 4, num_layers=2, seed=1)
    small, small_reg = _engine(64, num_layers=2, seed=2)
    out: dict = {"endpoint": "ipc://", "server": "orbitkv-cache-manager process, 4 data plane workers",
                 "transport": "ZMTP 3.0 on Unix stream sockets (orbitkv_fs.dataplane)"}
    try:
        c = RemoteClient(endpoint, timeout=1)
        deadline = time.monotonic() + 60
        while True:
            try:
                c.ping()
                break
            except OrbitKVError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the cache manager did not start") from None
        c.close()
        c = RemoteClient(endpoint)
        se = c.register(small_reg)
        keys = [chunk_key(f"k{i}") for i in range(64)]
        c.save(se.engine_id, [ChunkBlocks(k, [i]) for i, k in enumerate(keys)])
        _time_calls(lambda: c.lookup(se.engine_id, keys, lease=False), 200)  # warm up
        out["libzmq_echo"] = _libzmq_echo(f"ipc://{tmp}/echo.sock", n)
        out["ping"] = _pcts(_time_calls(c.ping, n, "ping"))
        out["empty_lookup"] = _pcts(_time_calls(lambda: c.lookup(se.engine_id, [], lease=False), n, "empty lookups"))
        out["lookup_64"] = _pcts(_time_calls(lambda: c.lookup(se.engine_id, keys, lease=False), n, "64-key lookups"))
        leases: list[int] = []
        out["lookup_64_leased"] = _pcts(_time_calls(lambda: leases.append(c.lookup(se.engine_id, keys).lease_id), n,
                                                    "leased lookups"))
        for lid in leases:
            c.release(lid)
        assert c.lookup(se.engine_id, keys, lease=False).count == 64

        chunks = [ChunkBlocks(chunk_key(f"mb{i}"), list(range(i * per, (i + 1) * per))) for i in range(4)]
        seg_bytes = 1 << 20
        segs = len(chunks) * 2 * 2

        def cycle(client, engine_id, saves: list[float], restores: list[float]) -> None:
            client.invalidate(engine_id=engine_id)
            t = time.perf_counter()
            client.save(engine_id, chunks)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = client.restore(engine_id, chunks)
            restores.append(time.perf_counter() - t)
            assert all(r.restored)

        # Remote and embedded alternate rep by rep, so that the load of a shared machine hits both alike.
        reps = max(10, n // 100)
        rs: list[float] = []
        rr: list[float] = []
        es: list[float] = []
        er: list[float] = []
        re = c.register(reg)
        with Manager(ManagerConfig(pool_size=512 << 20, device="cpu")) as m:
            from orbitkv_fs.client import connect

            ec = connect(m)
            ee = ec.register(reg)
            for _ in range(reps):
                cycle(c, re.engine_id, rs, rr)
                cycle(ec, ee.engine_id, es, er)
        c.unregister(re.engine_id)
        med = statistics.median
        out["segments_1mib"] = {
            "segments_per_call": segs, "segment_bytes": seg_bytes, "reps": reps,
            "save_embedded_ms": med(es) * 1e3, "save_remote_ms": med(rs) * 1e3,
            "restore_embedded_ms": med(er) * 1e3, "restore_remote_ms": med(rr) * 1e3,
            "save_overhead_us": (med(rs) - med(es)) * 1e6, "restore_overhead_us": (med(rr) - med(er)) * 1e6,
            "save_overhead_pct": (med(rs) / med(es) - 1) * 100, "restore_overhead_pct": (med(rr) / med(er) - 1) * 100,
        }
        c.close()
        return out
    finally:
        proc.terminate()
        proc.wait(30)
        pages.close()
        small.close()


def bench_index(n: int, segments_per_chunk: int) -> dict:
    """Heap bytes per segment of the index (and of index + each policy) holding ``n`` segments."""
    out: dict = {"segments": n, "segments_per_chunk": segments_per_chunk}
    ns = bytes(16)
    layers = segments_per_chunk // 2 or 1
    # The packed keys' (layer, role) tails, made once: a key is namespace + chunk + tail.
    tails = [ObjectKey(ns, ns, s % layers, Role.KEY if s < layers else Role.VALUE).pack()[32:]
             for s in range(segments_per_chunk)]
    for label in ("index", "index+lru", "index+s3fifo"):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        ix = ObjectIndex()
        pol = make_policy(label.split("+")[1]) if "+" in label else None
        i = 0
        while i < n:
            prefix = ns + (i // segments_per_chunk).to_bytes(16, "little")
            for s in range(min(segments_per_chunk, n - i)):
                kb = prefix + tails[s]
                slot, _ = ix.add(kb, i, 2, 1000, 2000, 0)
                if pol is not None:
                    pol.insert(slot, 1024, hash(kb))
                i += 1
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out[label.replace("+", "_") + "_bytes_per_segment"] = used / n
        del ix, pol
    return out


def _markdown(res: dict, command: str) -> str:
    lines = [f"# orbitkv-bench pipeline --device {res['device']}", "", f"Command: `{command}`", "",
             f"Host: {res['host']}", ""]
    if res.get("code"):
        c = res["code"]
        lines += [f"Code: git {c['git'] or '(none)'}{' with changes' if c['git_dirty'] == 'yes' else ''}, "
                  f"sources sha256 {c['source_sha256'][:16]}", ""]
    if "throughput" in res:
        t = res["throughput"]
        g = t["geometry"]
        lines += ["## Save / restore through the Manager", "",
                  f"Engine pages: {t['pages']}; {g['layers']} layers, {g['kv_heads']} KV heads x {g['head_dim']} x "
                  f"{g['block_tokens']} tokens BF16 (32 KiB per block, layer and role; {g.get('block_order', 'contiguous')} "
                  f"block ids per chunk); {g['logical_bytes_per_run'] >> 20} "
                  f"MiB per figure, best of the repeats; codec workspace (--storage-codec-budget) "
                  f"{g.get('storage_codec_budget', 64 << 20) >> 20} MiB, at most {g.get('batch_segments', BATCH_SEGMENTS)} segments per "
                  f"codec batch. TurboQuant keeps the first and last two layers exact "
                  f"(policy), so {4 / g['layers']:.0%} of its segments are raw here. Baseline: {t['baseline']}, measured right "
                  "before the rows of each segment size, best of the same number of repeats. "
                  + ("Codecs run round robin (each repeat runs every codec once), so their best-of figures sample the "
                     "same stretches of the machine. " if t.get("round_robin") else "")
                  + "'vs none' compares logical GB/s with codec none at the same segment size. The process freezes "
                  "its start-up heap (gc.freeze) once the Managers have started, as orbitkv-cache-manager does.", "",
                  "'bound vs none' is the most the codec can reach: its stored bytes moved at the baseline's rate, "
                  "with its encode, decode and host work free, against none.", "",
                  "| codec | segment | save GB/s | restore GB/s | baseline save / restore GB/s | save / baseline | "
                  "restore / baseline | save vs none | restore vs none | stored / logical | bound vs none save / restore |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in t["runs"]:
            lines.append(f"| {r['codec']} | {r['segment_bytes'] >> 10} KiB | {r['save_gbs']:.3f} | {r['restore_gbs']:.3f} "
                         f"| {r['save_baseline_gbs']:.2f} / {r['restore_baseline_gbs']:.2f} | {r['save_vs_baseline']:.2f} | "
                         f"{r['restore_vs_baseline']:.2f} | {r.get('save_vs_none', float('nan')):.2f} | "
                         f"{r.get('restore_vs_none', float('nan')):.2f} | {r['stored_bytes'] / r['logical_bytes']:.3f} | "
                         f"{r.get('save_bound_vs_none', float('nan')):.2f} / {r.get('restore_bound_vs_none', float('nan')):.2f} |")
        lines.append("")
        if any("save_cpu_us_per_segment" in r for r in t["runs"]):
            names = sorted({k for r in t["runs"] for k in r.get("stage_cpu_us_per_segment", {})},
                           key=lambda k: (not k.startswith("save"), k not in ("save", "restore"), k.endswith("_other"), k))
            lines += ["Host CPU per segment (this thread's `time.thread_time` around each call, the repeats after the "
                      "first, divided by the segments; on this CPU path it includes the copies and CRC32C the host "
                      "does). A CUDA wait spins, so on the GPU path CPU time includes the host's waits on the GPU "
                      "engine's streams: `wait` columns (`ManagerStats.gpu_wait_seconds`); CPU minus wait is the "
                      "host's own work. Stages: the Manager's own counts (`ManagerStats.host_cpu_seconds`); `*_other` "
                      "is the request's time outside the named stages. `host probe`: microseconds of a fixed dict, "
                      "list and numpy workload (best of 5) right before each call, the median over the counted "
                      "calls (range in the JSON, with each call's seconds, probe and host work): the host's speed "
                      "then, higher on a slower host.", "",
                      "| codec | segment | host probe us | save us/seg | save wait | restore us/seg | restore wait | "
                      + " | ".join(names) + " |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(names)]
            for r in t["runs"]:
                st = r.get("stage_cpu_us_per_segment", {})
                lines.append(f"| {r['codec']} | {r['segment_bytes'] >> 10} KiB | {r.get('host_probe_us', float('nan')):.0f} | "
                             f"{r['save_cpu_us_per_segment']:.2f} | "
                             f"{r.get('save_wait_us_per_segment', 0.0):.2f} | "
                             f"{r['restore_cpu_us_per_segment']:.2f} | {r.get('restore_wait_us_per_segment', 0.0):.2f} | "
                             + " | ".join(f"{st[k]:.2f}" if k in st else "-" for k in names) + " |")
            lines.append("")
    if "dataplane" in res:
        d = res["dataplane"]
        lines += ["## Remote data plane", "", f"Client in this process, {d['server']}, over {d['endpoint']}; "
                  f"transport: {d.get('transport', 'libzmq REQ/ROUTER')}. Baselines in the same run: `ping` (the "
                  "transport and server loop with no Manager call) and `libzmq_echo` (a pyzmq REQ -> ROUTER echo "
                  "of 1.2 kB in another process, the floor of the previous libzmq transport). "
                  "Target: lookup_64 p50 <= 150 us.", "",
                  "| round trip | p50 us | p99 us | n |", "| --- | ---: | ---: | ---: |"]
        for k in ("libzmq_echo", "ping", "empty_lookup", "lookup_64", "lookup_64_leased"):
            if k in d:
                lines.append(f"| {k} | {d[k]['p50_us']:.0f} | {d[k]['p99_us']:.0f} | {d[k]['n']} |")
        s = d["segments_1mib"]
        lines += ["", f"Save and restore of {s['segments_per_call']} segments of 1 MiB per call (codec none), median of "
                  f"{s['reps']}, remote and embedded alternating:", "", "| call | embedded ms | remote ms | overhead us | overhead % |",
                  "| --- | ---: | ---: | ---: | ---: |",
                  f"| save | {s['save_embedded_ms']:.2f} | {s['save_remote_ms']:.2f} | {s['save_overhead_us']:.0f} | "
                  f"{s['save_overhead_pct']:.1f} |",
                  f"| restore | {s['restore_embedded_ms']:.2f} | {s['restore_remote_ms']:.2f} | "
                  f"{s['restore_overhead_us']:.0f} | {s['restore_overhead_pct']:.1f} |", ""]
    if "index" in res:
        lines += ["## Index memory", "", "| segments | segments per chunk | index B/segment | + LRU | + S3-FIFO |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for ix in res["index"]:
            lines.append(f"| {ix['segments']:,} | {ix['segments_per_chunk']} | {ix['index_bytes_per_segment']:.0f} | "
                         f"{ix['index_lru_bytes_per_segment']:.0f} | {ix['index_s3fifo_bytes_per_segment']:.0f} |")
        lines += ["", "Target: <= 256 bytes per segment (Python heap, tracemalloc: keys, dicts, columns, lists).", ""]
    return "\n".join(lines)


def _write_profiles(profiles: "dict[str, cProfile.Profile]", out: str, device: str, throughput: dict,
                    repeat: int) -> None:
    """Each profile as ``profile-<device>-<save|restore>.prof`` (for pstats) and ``.txt``: by own time, the
    call counts beside the segments the profiled calls moved (a count near a multiple of the codec batches is
    per-batch work; near the segments, per-segment work)."""
    os.makedirs(out, exist_ok=True)
    segments = sum(r["segments"] for r in throughput["runs"]) * max(repeat - 1, 0)
    for op, prof in profiles.items():
        stem = os.path.join(out, f"profile-{device}-{op}")
        prof.dump_stats(stem + ".prof")
        with open(stem + ".txt", "w") as f:
            f.write(f"{op}: the repeats after the first, {segments} segments\n")
            if segments:  # an empty profile (one repeat) has no stats to print
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(80)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench pipeline", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: host pages and host codecs; gpu: CUDA IPC pages and the GPU codec engine")
    p.add_argument("--codecs", default=None, help="comma list (default: none,fp8,turboquant-4,turboquant-3; +ans on gpu)")
    p.add_argument("--blocks", type=int, default=128, help="engine blocks per figure (64 KiB per layer)")
    p.add_argument("--segment-kib", default=",".join(str(x >> 10) for x in SEGMENT_SIZES),
                   help="segment sizes of the throughput part, KiB, comma list (multiples of 32)")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="engine layers (TurboQuant keeps 4 exact: its share of raw segments is 4 / layers)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (the best is reported)")
    p.add_argument("--storage-codec-budget-mib", type=int, default=64,
                   help="the Manager's --storage-codec-budget in MiB (an engine flight takes half of it on a GPU)")
    p.add_argument("--batch-segments", type=int, default=BATCH_SEGMENTS,
                   help=f"the Manager's segments per codec batch, at most (default {BATCH_SEGMENTS})")
    p.add_argument("--latency-samples", type=int, default=3000, help="calls per data-plane latency figure")
    p.add_argument("--index-segments", type=int, default=1_000_000, help="segments in the index-memory part")
    p.add_argument("--only", default="throughput,dataplane,index", help="which parts to run")
    p.add_argument("--block-order", choices=("contiguous", "shuffled"), default="contiguous",
                   help="block ids of a chunk: consecutive, or random (an engine's fragmented free list)")
    p.add_argument("--profile", action="store_true",
                   help="profile the saves and restores of the repeats after the first (cProfile) into "
                        "<out>/profile-<device>-{save,restore}.{prof,txt}")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--out", default=None, help="directory for pipeline-<device>.json and .md (default: print only)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.profile and not args.out:
        p.error("--profile needs --out")
    if args.blocks < (4 << 20) // BLOCK_BYTES:
        p.error(f"--blocks must be at least {(4 << 20) // BLOCK_BYTES} (one 4 MiB segment)")
    if args.device == "gpu" and "throughput" in args.only.split(","):
        from orbitkv_fs.gpu import unusable_reason

        why = unusable_reason()
        if why is not None:  # before the engine process starts: it would die on its first CUDA call
            print(f"orbitkv-bench pipeline --device gpu: the GPU stack is not usable here ({why}); "
                  "pip install 'orbitkv-fs[gpu]' on a machine with a CUDA GPU", file=sys.stderr)
            return 2
    codecs = args.codecs.split(",") if args.codecs else \
        ["none", "fp8", "turboquant-4", "turboquant-3"] + (["ans"] if args.device == "gpu" else [])
    parts = set(args.only.split(","))
    res: dict = {"device": args.device,
                 "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                         f"numpy {np.__version__}",
                 "code": code_identity()}
    if "throughput" in parts:
        profiles = {"save": cProfile.Profile(), "restore": cProfile.Profile()} if args.profile else None
        sizes = [int(x) << 10 for x in args.segment_kib.split(",")]
        res["throughput"] = (bench_throughput(codecs, args.blocks, args.repeat, "cpu", args.block_order, args.layers,
                                              sizes, args.batch_segments, profiles) if args.device == "cpu" else
                             bench_throughput_gpu(codecs, args.blocks, args.repeat, args.block_order, args.layers, sizes,
                                                  args.storage_codec_budget_mib << 20, args.batch_segments, profiles))
        if profiles:
            _write_profiles(profiles, args.out, args.device, res["throughput"], args.repeat)
    if "dataplane" in parts:
        res["dataplane"] = bench_dataplane(args.latency_samples)
    if "index" in parts:
        res["index"] = [bench_index(args.index_segments, n) for n in (60, 2, 1)]
    res["load_average_1m"] = os.getloadavg()[0]
    res["host"] += f"; 1-minute load average at the end {res['load_average_1m']:.2f} (shared machine)"
    command = "orbitkv-bench pipeline " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"pipeline-{args.device}.json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(args.out, f"pipeline-{args.device}.md"), "w") as f:
            f.write(_markdown(res, command))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(_markdown(res, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
