"""``orbitkv-bench peer``: peer fetch throughput and remote-hit latency over the Transfer Engine.

Owns :class:`ShmArena` -- a minimal standalone :class:`~orbitkv_fs.peers.PeerSource` (segments placed
in one ``/dev/shm`` file, leases by key) so that the peer layer can be measured, and tested, on its own
real shared-memory arena in a separate process -- and the benchmark: a serving process fills its arena
with CRC-valid segments; this process fetches them through :class:`~orbitkv_fs.peers.PeerClient` (lease
round trip, Transfer Engine reads, release, header and CRC32C verification, copy out) and, in the same
run, reads the very same extents with a raw Transfer Engine batch read. Reported per segment size:
GB/s of both (best of ``--repeat`` interleaved passes, and medians) and their ratios, and p50/p99 of a
one-segment remote hit. The serving side is a real Manager by default (``--source shm``: the fixture arena).

``python -m orbitkv_fs.tools.bench_peer serve`` runs the serving side (used by the benchmark and tests).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from orbitkv_fs.console import HelpFormatter
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.progress import progress
from orbitkv_fs.provenance import code_identity
from orbitkv_fs.segment import Format, Role, SegmentHeader, build_segment

__all__ = ["ShmArena", "make_segments", "main", "start_server"]

_ALIGN = 4096


@dataclass(frozen=True)
class _Extent:
    offset: int
    length: int
    generation: int


class ShmArena:
    """Segments in one shared-memory file, leased by key. Not an allocator: objects are appended and
    never freed (a benchmark and test fixture, not a cache)."""

    def __init__(self, size: int, namespaces: Sequence[bytes], *, shm_dir: str = "/dev/shm") -> None:
        self.path = os.path.join(shm_dir, f"orbitkv-peer-arena-{os.getpid()}-{id(self):x}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            # Peers reach the arena by address, never by name: without its name the memory goes back to
            # the system when the process ends however it ends (the fault tests SIGKILL servers).
            os.unlink(self.path)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base_address = ctypes.addressof(self._anchor)
        self.size = size
        self._namespaces = list(namespaces)
        self._objects: dict[ObjectKey, _Extent] = {}
        self._leases: dict[int, list[ObjectKey]] = {}
        self._ids = itertools.count(1)
        self._next = 0
        self._gen = itertools.count(1)
        self._lock = threading.Lock()
        self.fetcher = None

    def put(self, key: ObjectKey, segment: bytes) -> _Extent:
        with self._lock:
            off = self._next
            if off + len(segment) > self.size:
                raise MemoryError(f"arena of {self.size} bytes is full")
            self._mm[off: off + len(segment)] = segment
            self._next = -(-(off + len(segment)) // _ALIGN) * _ALIGN
            ext = _Extent(off, len(segment), next(self._gen))
            self._objects[key] = ext
            return ext

    def corrupt(self, key: ObjectKey) -> None:
        """Fault injection: flip one payload byte of ``key`` in place."""
        ext = self._objects[key]
        i = ext.offset + ext.length - 1
        self._mm[i] ^= 0xFF

    # -- PeerSource ----------------------------------------------------------------------------------

    def lease_objects(self, keys: Sequence[ObjectKey]) -> tuple[int, list[_Extent | None]]:
        with self._lock:
            out = [self._objects.get(k) for k in keys]
            lease = next(self._ids)
            self._leases[lease] = [k for k, e in zip(keys, out) if e is not None]
            return lease, out

    def release(self, lease_id: int) -> None:
        with self._lock:
            if self._leases.pop(lease_id, None) is None:
                raise KeyError(lease_id)

    @property
    def leases_active(self) -> int:
        with self._lock:
            return len(self._leases)

    def arena_info(self) -> SimpleNamespace:
        """Where the arena lies (``path`` names the file it was made as, already removed)."""
        return SimpleNamespace(path=self.path, size=self.size, base_address=self.base_address, pinned=False)

    def list_engines(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(namespace=ns.hex()) for ns in self._namespaces]

    def set_peer_fetcher(self, fetcher) -> None:
        self.fetcher = fetcher

    def close(self) -> None:
        del self._anchor
        self._mm.close()


def make_segments(namespace: bytes, count: int, size: int, seed: int, *, layers: int = 1
                  ) -> list[tuple[ObjectKey, bytes]]:
    """``count`` deterministic raw segments of ``size`` payload bytes (same seed -> same bytes)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        chunk = (seed.to_bytes(8, "little") + i.to_bytes(8, "little"))
        layer, role = i % layers, Role.KEY if i % 2 == 0 else Role.VALUE
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        h = SegmentHeader(Format.RAW, np.dtype(np.uint8), size, size, 0, role=role, layer=layer)
        out.append((ObjectKey(namespace, chunk, layer, role), build_segment(h, payload)))
    return out


def _serve(args: argparse.Namespace) -> int:
    from orbitkv_fs.peers import PeerConfig, PeerNode

    ns = bytes.fromhex(args.namespace)
    serve_ns = [bytes.fromhex(n) for n in (args.serve_namespace or [args.namespace])]
    segs = []
    for spec in args.segments:  # count:size:seed
        count, size, seed = (int(x) for x in spec.split(":"))
        segs += make_segments(ns, count, size, seed)
    need = sum(-(-len(s) // _ALIGN) * _ALIGN for _, s in segs) + _ALIGN
    if args.source == "manager":
        source, close_source, extents = _manager_source(segs, need, serve_ns)
    else:
        arena = ShmArena(max(need, 1 << 20), serve_ns)
        for k, s in segs:
            arena.put(k, s)
        for i in args.corrupt:
            arena.corrupt(segs[i][0])
        source, close_source = arena, arena.close
        extents = [arena._objects[k] for k, _ in segs]
    for ms, sig in ((args.die_after_lease_ms, signal.SIGKILL), (args.stop_after_lease_ms, signal.SIGSTOP)):
        if ms >= 0:
            # Fault injection: die (SIGKILL, no cleanup) or freeze (SIGSTOP) that long after a lease was
            # granted, i.e. while the requester's reads are in flight.
            def faulty_lease(keys, _lease=source.lease_objects, _ms=ms, _sig=sig):
                threading.Timer(_ms / 1000, os.kill, (os.getpid(), _sig)).start()
                return _lease(keys)

            source.lease_objects = faulty_lease
    node = PeerNode(source, host=args.host, port=args.port, peers=args.peer,
                    config=PeerConfig(staging_bytes=1 << 20), lease_ttl_s=args.lease_ttl,
                    namespaces=lambda: serve_ns)
    print(json.dumps({"address": node.address, "session_id": node.transport.session_id,
                      "base_address": source.arena_info().base_address, "pid": os.getpid(),
                      "extents": [[e.offset, e.length] for e in extents]}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set() and sys.stdin.readline():  # runs until stdin closes or SIGTERM
            pass
    finally:
        node.close()
        close_source()
    return 0


def _manager_source(segs: list[tuple[ObjectKey, bytes]], need: int, namespaces: list[bytes]):
    """A real Manager holding ``segs``, put in place through its transfer API (reserve, write, publish)."""
    from orbitkv_fs.manager import Manager, ManagerConfig

    m = Manager(ManagerConfig(pool_size=need + need // 4 + (4 << 20), device="cpu"))
    info = m.arena_info()
    with open(info.path, "r+b") as f, mmap.mmap(f.fileno(), info.size) as mm:
        for k, seg in segs:
            res = m.reserve(len(seg))
            mm[res.offset: res.offset + len(seg)] = seg
            if not m.publish(res, k):
                raise RuntimeError(f"the Manager refused segment {k}")
    lease, extents = m.lease_objects([k for k, _ in segs])
    m.release(lease)
    return m, m.close, extents


def start_server(namespace: bytes, segments: Sequence[str], *, extra: Sequence[str] = ()
                 ) -> tuple[subprocess.Popen, dict]:
    """Start ``serve`` in a child process; answer (process, its JSON greeting)."""
    cmd = [sys.executable, "-m", "orbitkv_fs.tools.bench_peer", "serve", "--namespace", namespace.hex()]
    for s in segments:
        cmd += ["--segments", s]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"peer server exited with {proc.wait()}")
    return proc, json.loads(line)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _gbps(nbytes: int, t: float) -> float:
    return round(nbytes / t / 1e9, 4)


def _bench(args: argparse.Namespace) -> dict:
    from orbitkv_fs.manager import Manager, ManagerConfig
    from orbitkv_fs.errors import OrbitKVError
    from orbitkv_fs.peers import PeerConfig, PeerNode, transport_available

    if not transport_available():  # one clear error here, not a dead server process
        raise OrbitKVError("needs the mooncake Transfer Engine: install the peer extra, pip install "
                           "'orbitkv-fs[peer]' (CPU hosts; Debian's libibverbs1 and libfabric1 too), or "
                           "mooncake-transfer-engine on CUDA hosts")

    ns = bytes(range(16))
    sizes = [int(s) for s in args.sizes]
    specs = [f"{max(1, args.bytes_per_size // s)}:{s}:{i + 1}" for i, s in enumerate(sizes)]
    load_before = os.getloadavg()[0]
    proc, hello = start_server(ns, specs, extra=["--source", args.source])
    # The requester is a real Manager with its peer layer: fetch() copies verified segments out of staging
    # memory; fetch_into() reads them straight into this Manager's arena and publishes them there.
    sink = Manager(ManagerConfig(pool_size=2 * args.bytes_per_size + (64 << 20), device="cpu"))
    node = PeerNode(sink, peers=[hello["address"]],
                    config=PeerConfig(budget_s=30.0, fanout=1, staging_bytes=args.bytes_per_size + (64 << 20)))
    client, transport = node.client, node.transport
    raw_mm = mmap.mmap(-1, args.bytes_per_size + (64 << 20))
    raw_anchor = ctypes.c_char.from_buffer(raw_mm)
    raw_addr = ctypes.addressof(raw_anchor)
    transport.register(raw_addr, len(raw_mm))
    bar = progress(len(sizes) * (args.repeat + args.latency_samples), "peer", "fetch")
    try:
        results = []
        extents = hello["extents"]
        first = 0
        for i, s in enumerate(sizes):
            count = max(1, args.bytes_per_size // s)
            segs = make_segments(ns, count, s, i + 1)
            keys = [k for k, _ in segs]
            ext = extents[first: first + count]
            first += count
            nbytes = sum(len(b) for _, b in segs)
            remotes = [hello["base_address"] + o for o, _ in ext]
            lengths = [ln for _, ln in ext]
            locals_, off = [], 0
            for ln in lengths:
                locals_.append(raw_addr + off)
                off += -(-ln // 4096) * 4096
            # Warm every path (connections, first touch of the destination memory) before timing.
            transport.read_batch(hello["session_id"], locals_, remotes, lengths)
            got = client.fetch(keys)
            assert all(got[k] == b for k, b in segs), "peer fetch returned wrong bytes"
            del got
            assert len(client.fetch_into(sink, keys)) == count
            assert all(sink.read_object(k) == b for k, b in segs), "fetch_into published wrong bytes"
            sink.invalidate(keys=keys)
            raw_t, copy_t, into_t = [], [], []
            for _ in range(args.repeat):
                # Interleaved so that all three see the same machine load.
                t = time.perf_counter()
                transport.read_batch(hello["session_id"], locals_, remotes, lengths)
                raw_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = client.fetch(keys)
                copy_t.append(time.perf_counter() - t)
                if len(got) != count:
                    raise RuntimeError(f"peer fetch missed {count - len(got)} of {count} segments")
                del got
                t = time.perf_counter()
                n = len(client.fetch_into(sink, keys))
                into_t.append(time.perf_counter() - t)
                if n != count:
                    raise RuntimeError(f"peer fetch_into missed {count - n} of {count} segments")
                sink.invalidate(keys=keys)
                bar.update()
            lat = []
            for j in range(args.latency_samples):
                k = keys[j % count]
                t = time.perf_counter()
                ok = client.fetch_into(sink, [k])
                lat.append(time.perf_counter() - t)
                assert ok == [k]
                sink.invalidate(keys=[k])
                bar.update()
            raw, copy, into = (np.array(x) for x in (raw_t, copy_t, into_t))
            results.append({
                "segment_bytes": s, "segments": count, "bytes": nbytes,
                "raw_te_read_GBps": _gbps(nbytes, raw.min()),
                "peer_fetch_into_GBps": _gbps(nbytes, into.min()),
                "peer_fetch_copy_GBps": _gbps(nbytes, copy.min()),
                # Each pass runs the three back to back: the median of per-pass ratios is the figure least
                # moved by the host's load changing during the run.
                "ratio_into": round(float(np.median(raw / into)), 3),
                "ratio_copy": round(float(np.median(raw / copy)), 3),
                "raw_te_read_GBps_median": _gbps(nbytes, float(np.median(raw))),
                "peer_fetch_into_GBps_median": _gbps(nbytes, float(np.median(into))),
                "peer_fetch_copy_GBps_median": _gbps(nbytes, float(np.median(copy))),
                "remote_hit_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
                "remote_hit_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
            })
            bar.write(json.dumps(results[-1]))
    finally:
        bar.close()
        transport.unregister(raw_addr)
        del raw_anchor
        raw_mm.close()
        node.close()
        sink.close()
        stop_server(proc)
    return {
        "benchmark": "peer",
        "command": "orbitkv-bench peer " + " ".join(args.argv),
        "transport": "mooncake TransferEngine, tcp, P2P handshake, 127.0.0.1 (two processes)",
        "source": args.source,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "code": code_identity(),
        "repeat": args.repeat, "latency_samples": args.latency_samples,
        # The figures are only as steady as the host: its 1-minute load average around the run.
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "results": results,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="orbitkv-bench peer", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", title="subcommands (default: run the benchmark)")
    sv = sub.add_parser("serve", help="run a peer server over a shm arena of generated segments",
                        formatter_class=HelpFormatter)
    sv.add_argument("--namespace", required=True, help="hex namespace of the generated segments")
    sv.add_argument("--serve-namespace", action="append", help="namespaces served (default: --namespace)")
    sv.add_argument("--segments", action="append", default=[], help="count:size:seed (repeatable)")
    sv.add_argument("--source", choices=("shm", "manager"), default="shm",
                    help="what serves: a standalone shm arena, or a real Manager")
    sv.add_argument("--corrupt", action="append", type=int, default=[],
                    help="index of a segment to corrupt (shm source)")
    sv.add_argument("--die-after-lease-ms", type=float, default=-1,
                    help="fault: SIGKILL itself this long after a lease (default -1: never)")
    sv.add_argument("--stop-after-lease-ms", type=float, default=-1,
                    help="fault: SIGSTOP itself this long after a lease (default -1: never)")
    sv.add_argument("--lease-ttl", type=float, default=60.0, help="seconds a lease lives unreleased")
    sv.add_argument("--host", default="127.0.0.1", help="address the server binds")
    sv.add_argument("--port", type=int, default=0, help="control port (default 0: a free one)")
    sv.add_argument("--peer", action="append", default=[], help="a peer's host:port (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--source", choices=("manager", "shm"), default="manager",
                    help="serving side: a real Manager or the standalone shm arena")
    ap.add_argument("--sizes", nargs="+", default=[str(64 << 10), str(256 << 10), str(1 << 20), str(4 << 20)],
                    help="segment sizes in bytes")
    ap.add_argument("--bytes-per-size", type=int, default=32 << 20, help="bytes fetched per timed pass")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes per size")
    ap.add_argument("--latency-samples", type=int, default=200, help="single-key fetches per size for latency")
    ap.add_argument("--out", help="also write the JSON here (default: print only)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["peer"]:
        argv = argv[1:]
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return _serve(args)
    args.argv = argv
    res = _bench(args)
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        for r in res["results"]:
            print(f"{r['segment_bytes']:>9} B x{r['segments']:<5} raw {r['raw_te_read_GBps']:.3f} GB/s  "
                  f"fetch_into {r['peer_fetch_into_GBps']:.3f} GB/s ({r['ratio_into']:.2f}x)  "
                  f"fetch {r['peer_fetch_copy_GBps']:.3f} GB/s ({r['ratio_copy']:.2f}x)  "
                  f"hit p50 {r['remote_hit_p50_ms']:.3f} ms p99 {r['remote_hit_p99_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
