"""``orbitkv-cache-manager``: the Manager as a process.

Owns the command line and the process lifecycle: build the arguments (:func:`build_parser`, the one place
other parts add their flags), turn them into a :class:`~orbitkv_fs.manager.ManagerConfig`
(:func:`config_from_args`), start the Manager (:func:`build_manager`) and its data plane, then wait for
SIGINT/SIGTERM and shut down in order: stop accepting requests, let in-flight ones finish, close the
Manager (which flushes and closes the lower tier and unlinks the arena).

Defaults run on a laptop without a GPU: 1 GiB of DRAM, codec ``none``, everything bound to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import resource
import signal
import sys
import threading
from typing import Callable

from orbitkv_fs.codecs import CODEC_NAMES
from orbitkv_fs.console import HelpFormatter, entry_point
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.progress import progress
from orbitkv_fs.server.connections import HttpLimits

log = logging.getLogger("orbitkv.cache_manager")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``8gb``, ``512MiB``, ``1073741824`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 512mb, 8gb, 1073741824")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return n


def _codec_budget(text: str) -> int:
    n = parse_size(text)
    if n < 1 << 20:
        raise argparse.ArgumentTypeError("the codec budget must be at least 1mb")
    return n


#: uvicorn's TRACE level (below DEBUG), which ``--log-level trace`` asks for.
TRACE = 5
_LOG_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
               "error": logging.ERROR, "critical": logging.CRITICAL}


def parse_log_level(text: str) -> str:
    """A log level name (any case): trace, debug, info, warning, error, critical."""
    name = text.strip().lower()
    if name not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"bad log level {text!r}; use one of {', '.join(_LOG_LEVELS)}")
    return name


def _number(cast: Callable[[str], float], ok: Callable[[float], bool], must: str) -> Callable[[str], float]:
    """An argparse type: ``cast(text)``, for which ``ok`` must hold (else: "must ``must``")."""
    def parse(text: str) -> float:
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad number {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must {must}")
        return v

    return parse


def _positive(cast: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: ``cast(text)``, which must be > 0."""
    return _number(cast, lambda v: v > 0, "be > 0")


#: An argparse type: a fraction within [0, 1] (NaN is not).
_share = _number(float, lambda v: 0.0 <= v <= 1.0, "be within [0, 1]")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``orbitkv-cache-manager``. Other parts (HTTP, SSD, peers) add theirs here."""
    p = argparse.ArgumentParser(prog="orbitkv-cache-manager",
                                description="OrbitKV-FS cache manager: DRAM arena, codecs, data plane.",
                                formatter_class=HelpFormatter)
    g = p.add_argument_group("manager")
    g.add_argument("--pool-size", type=parse_size, default=1 << 30,
                   help="DRAM arena size (shared-memory file), e.g. 8gb (default 1gb)")
    g.add_argument("--storage-codec", choices=CODEC_NAMES, default="none",
                   help="default codec of registered engines (default none; fp8/turboquant-* are lossy)")
    g.add_argument("--storage-codec-budget", type=_codec_budget, default=64 << 20,
                   help="codec workspace per worker, e.g. 64mb: bounds the GPU workspace; the GPU engine runs "
                        "codec batches in flights of at most half of it (default 64 MiB, at least 1 MiB)")
    g.add_argument("--batch-segments", type=_positive(int), default=ManagerConfig().batch_segments, metavar="N",
                   help="segments per codec batch, at most; the codec budget closes a batch earlier where segments "
                        "are large. Fewer, larger batches cost less host time per segment; smaller ones overlap "
                        "more of a request's host and GPU work (default %(default)s)")
    g.add_argument("--eviction", choices=("lru", "s3fifo"), default="lru", help="DRAM eviction policy")
    g.add_argument("--shm-dir", default="/dev/shm",
                   help="directory of the arena file (a tmpfs); engines' host pages files must lie in it too")
    g.add_argument("--reserve-pool", action=argparse.BooleanOptionalAction, default=True,
                   help="allocate the whole pool in --shm-dir at start (refused there when it does not fit: "
                        "a container's /dev/shm is 64 MiB unless sized); --no-reserve-pool: only check the "
                        "directory's free space, and take pages as the pool fills")
    g.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="auto: pin the arena and use the GPU codec engine when a GPU is present")
    g.add_argument("--engine-check-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often to check that registered engines' processes still run (0: never; a dead "
                        "engine is unregistered as by DELETE /v1/engines/{id})")
    g.add_argument("--lease-ttl", type=float, default=300.0, metavar="SECONDS",
                   help="how long a lookup's lease pins its chunks without a restore or release (0: forever)")
    g.add_argument("--max-leases-per-engine", type=_positive(int), default=ManagerConfig().max_leases_per_engine,
                   metavar="N", help="lookup leases one engine may hold at once; past it the engine's oldest lease "
                                     "ends early (default %(default)s)")
    g.add_argument("--max-leased-chunks-per-engine", type=_positive(int),
                   default=ManagerConfig().max_leased_chunks_per_engine, metavar="N",
                   help="chunks one engine's leases may pin at once (about 150 bytes of the Manager's memory each); "
                        "past it the engine's oldest leases end early, and a lookup over it alone gets no lease "
                        "(default %(default)s)")
    g.add_argument("--max-pinned-share", type=_share, default=ManagerConfig().max_pinned_share, metavar="F",
                   help="share of the pool that lookup leases' pins keep from eviction, all engines together; past "
                        "it evictions take pinned chunks too, oldest first, from the namespaces whose pins hold "
                        "more than an equal part of it (default %(default)s)")
    g.add_argument("--max-engines-per-user", type=_positive(int), default=ManagerConfig().max_engines_per_user,
                   metavar="N", help="engines one OS user may have registered at once (default %(default)s)")
    g.add_argument("--max-tensors-per-user", type=_positive(int), default=ManagerConfig().max_tensors_per_user,
                   metavar="N", help="tensors across one OS user's registered engines; each costs the Manager "
                                     "about 1.6 KB (default %(default)s)")
    g.add_argument("--data-plane", default="tcp://127.0.0.1:9092",
                   help="ZeroMQ endpoint of the data plane (ipc://PATH or tcp://127.0.0.1:PORT)")
    g.add_argument("--data-plane-workers", type=int, default=4,
                   help="saves, restores, registrations, invalidations and lookups that may read the SSD tier or "
                        "peers, running at once (DRAM-only lookups, pings and stats never wait)")
    g.add_argument("--data-plane-max-connections", type=_positive(int), default=1024, metavar="N",
                   help="data-plane connections open at once; at the limit a new one displaces the anonymous "
                        "connection idle longest (an engine's own connections are never displaced), else is "
                        "refused with an error it reads (default 1024)")
    g.add_argument("--data-plane-max-buffered", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="bytes of data-plane requests held at once, all connections together (each message's "
                        "first 64 KiB excepted); a message over it is dropped and answered DataPlaneBusy "
                        "(default 256mb)")
    g.add_argument("--data-plane-message-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="longest a data-plane handshake, or a message from its first byte to its last, may take "
                        "(default 30)")
    g.add_argument("--log-level", type=parse_log_level, default="info", metavar="LEVEL",
                   help="trace, debug, info (default), warning, error or critical (warning: errors and warnings "
                        "only, no access log)")
    g = p.add_argument_group("ssd tier (omit --ssd-cache-path for DRAM only; see docs/ssd.md)")
    g.add_argument("--ssd-cache-path", action="append", default=[], metavar="PATH",
                   help="shard file of the SSD tier, preallocated, O_DIRECT; repeat for one shard per path "
                        "(default: none, DRAM only)")
    g.add_argument("--ssd-cache-capacity", type=parse_size, default=None,
                   help="total SSD tier bytes over all shards, e.g. 100gb (no default: required with "
                        "--ssd-cache-path)")
    g.add_argument("--ssd-backend", choices=("auto", "uring", "cufile"), default="auto",
                   help="auto: io_uring; cufile: kvikio (GPU machines)")
    g.add_argument("--ssd-write-queue-depth", type=int, default=32, help="writes in flight (default 32)")
    g.add_argument("--ssd-recover", action="store_true",
                   help="rebuild the SSD index from the shard files (default: start empty, files truncated)")
    g.add_argument("--ssd-checkpoint-interval", type=float, default=1.0, metavar="SECONDS",
                   help="sync the shard files and checkpoint their logs this often (default 1; 0: only at "
                        "invalidation and clean shutdown): a crash can tear only records written since")
    g.add_argument("--ssd-read-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="a read of the SSD that sees no completion this long gives up (default 2): its chunks "
                        "miss, and reads of its shard miss at once until the disk answers again")
    g.add_argument("--ssd-start-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="the SSD tier's start (opening its shards, and with --ssd-recover reading them through) "
                        "that shows no progress this long is given up: a disk that does not answer. The manager "
                        "then serves with DRAM only, says so in its log, in /readyz (lower_tier_missing) and in "
                        "orbitkv_lower_tier_missing, and should be restarted once the disk answers (default 30)")
    g.add_argument("--ssd-prefetch-chunks", type=int, default=2,
                   help="after a lookup or restore hits SSD chunks of a prefix, read this many following "
                        "chunks of the prefix into DRAM in the background (default 2; 0: off)")
    g.add_argument("--ssd-prefetch-bytes", type=parse_size, default=32 << 20,
                   help="at most this many bytes per prefetch (default 32mb)")
    g = p.add_argument_group("http control plane (see docs/control-plane.md)")
    g.add_argument("--http-addr", default="127.0.0.1:9091",
                   help="host:port of the REST API and /metrics (default 127.0.0.1:9091; a non-loopback "
                        "address needs an admin token)")
    g.add_argument("--http-max-connections", type=_positive(int), default=HttpLimits().max_connections, metavar="N",
                   help="control-plane connections open at once; at the limit a new one displaces the connection "
                        "idle longest, else (every one answering a request) is answered 503 (default %(default)s)")
    g.add_argument("--http-request-timeout", type=_positive(float), default=HttpLimits().request_timeout_s,
                   metavar="SECONDS", help="longest a control-plane request may take to arrive, from a connection's "
                                           "start or the request's first byte to its last, and an answer to be "
                                           "taken (default %(default)g)")
    g.add_argument("--admin-token", default=None,
                   help="bearer token of mutating and admin endpoints (default: $ORBITKV_ADMIN_TOKEN); "
                        "prefer the environment variable, command lines are visible to other users")
    from orbitkv_fs.peers.node import add_peer_arguments

    add_peer_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> ManagerConfig:
    return ManagerConfig(pool_size=args.pool_size, storage_codec=args.storage_codec,
                         storage_codec_budget=args.storage_codec_budget, batch_segments=args.batch_segments,
                         eviction=args.eviction,
                         shm_dir=args.shm_dir, reserve_pool=args.reserve_pool, device=args.device,
                         engine_check_interval=args.engine_check_interval,
                         lease_ttl=args.lease_ttl, max_leases_per_engine=args.max_leases_per_engine,
                         max_leased_chunks_per_engine=args.max_leased_chunks_per_engine,
                         max_pinned_share=args.max_pinned_share,
                         max_engines_per_user=args.max_engines_per_user,
                         max_tensors_per_user=args.max_tensors_per_user,
                         ssd_prefetch_chunks=args.ssd_prefetch_chunks, ssd_prefetch_bytes=args.ssd_prefetch_bytes)


def build_lower_tier(args: argparse.Namespace):
    """The SSD tier the ``--ssd-*`` flags ask for, or None (DRAM only)."""
    if not getattr(args, "ssd_cache_path", None):
        return None
    from orbitkv_fs.tiers.ssd import SsdConfig
    from orbitkv_fs.tiers.ssd.start import SsdStartStalled, open_tier

    if args.ssd_cache_capacity is None:
        raise ValueError("--ssd-cache-path needs --ssd-cache-capacity (e.g. 100gb)")
    config = SsdConfig(paths=tuple(args.ssd_cache_path), capacity=args.ssd_cache_capacity,
                       backend=args.ssd_backend, write_queue_depth=args.ssd_write_queue_depth,
                       recover=args.ssd_recover, checkpoint_interval=args.ssd_checkpoint_interval,
                       read_timeout=args.ssd_read_timeout)
    stall = args.ssd_start_timeout
    try:
        if not args.ssd_recover:
            return open_tier(config, stall=stall)
        with progress(None, "recovering SSD shards", "B") as bar:  # a large cache takes a while to scan
            return open_tier(config, stall=stall, on_progress=bar.update_to)
    except SsdStartStalled as e:
        # DRAM serves without it: an engine's prefixes still hit there, where a Manager that waited for the
        # disk served nothing at all
        log.error("%s. The manager starts with DRAM only (no SSD tier); restart it once the disk answers", e)
        return None


def build_manager(args: argparse.Namespace) -> Manager:
    return Manager(config_from_args(args), lower_tier=build_lower_tier(args))


def _http_settings(args: argparse.Namespace):
    """``(host, port, AdminToken | None)`` of the control plane; raises when the address is not loopback
    and there is no token (the Manager must not start)."""
    from orbitkv_fs.server.app import parse_http_addr
    from orbitkv_fs.server.auth import AdminToken, check_bind

    host, port = parse_http_addr(args.http_addr)
    secret = args.admin_token if args.admin_token is not None else os.environ.get("ORBITKV_ADMIN_TOKEN")
    token = AdminToken(secret) if secret else None
    check_bind(host, token)
    return host, port, token


def _raise_fd_limit(connections: int) -> None:
    """Every data-plane and control-plane connection is a descriptor: lift the soft limit toward the hard one
    so that the connection limits, not EMFILE, are what bite (1024 is a common soft default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024  # arena, SSD shards, pages files, peers, the Python runtime
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
        if new < want:
            log.warning("descriptor limit %d: fewer than --data-plane-max-connections and --http-max-connections "
                        "(with the HTTP accept backlog, %d together) plus room; raise `ulimit -n`", new, connections)


@entry_point("orbitkv-cache-manager")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.addLevelName(TRACE, "TRACE")
    logging.basicConfig(level=_LOG_LEVELS[args.log_level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from orbitkv_fs.dataplane import DataPlaneLimits, DataPlaneServer
    from orbitkv_fs.errors import OrbitKVError

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        http_host, http_port, token = _http_settings(args)
    except (OrbitKVError, ValueError) as e:  # refuse before anything starts
        print(f"orbitkv-cache-manager: {e}", file=sys.stderr)
        return 2
    try:
        manager = build_manager(args)
    except (OrbitKVError, ValueError, OSError) as e:
        print(f"orbitkv-cache-manager: {e}", file=sys.stderr)
        return 2
    try:
        from orbitkv_fs.peers.node import start_from_args

        # Peers first: the data plane answers lookups from its first connection on, and a lookup served
        # before the peer node is attached would miss what peers hold.
        try:
            peers = start_from_args(manager, args)
        except (OrbitKVError, ValueError) as e:
            print(f"orbitkv-cache-manager: {e}", file=sys.stderr)
            return 2
        http_limits = HttpLimits(args.http_max_connections, args.http_request_timeout)
        _raise_fd_limit(args.data_plane_max_connections + http_limits.descriptors)
        limits = DataPlaneLimits(max_connections=args.data_plane_max_connections,
                                 max_buffered_bytes=args.data_plane_max_buffered,
                                 message_timeout_s=args.data_plane_message_timeout)
        try:
            dataplane = DataPlaneServer(manager, args.data_plane, workers=args.data_plane_workers, limits=limits,
                                        admin_token=token)
        except (OrbitKVError, ValueError) as e:
            if peers is not None:
                peers.close()
            print(f"orbitkv-cache-manager: {e}", file=sys.stderr)
            return 2
        from orbitkv_fs.server.app import HttpServer, create_app

        try:
            app = create_app(manager, admin_token=token, address=args.http_addr, peer_node=peers, dataplane=dataplane,
                             http_limits=http_limits, lower_tier_wanted="ssd" if args.ssd_cache_path else None)
            http = HttpServer(app, http_host, http_port, log_level=args.log_level,
                              access_log=log.isEnabledFor(logging.INFO)).start()
        except (OrbitKVError, ValueError) as e:
            dataplane.close()
            if peers is not None:
                peers.close()
            print(f"orbitkv-cache-manager: {e}", file=sys.stderr)
            return 2
        # Everything built so far (modules, cupy, the servers) lives as long as the process: keep it out of
        # the collector's full passes, which otherwise rescan it while requests allocate their per-segment
        # objects (a 4,096-segment lease: 4-5 us a segment, 3.3-3.5 us frozen, with torch's heap loaded).
        gc.freeze()
        info = manager.arena_info()
        log.info("ready: data plane %s, http %s%s, arena %s (%d MiB%s), codec %s", dataplane.endpoint, http.url,
                 " (admin token required)" if token is not None else "", info.path, info.size >> 20,
                 ", pinned" if info.pinned else "", args.storage_codec)
        try:
            while not stop.wait(0.5):
                pass
        finally:
            http.close()
            dataplane.close()
            if peers is not None:
                peers.close()
    finally:
        manager.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
