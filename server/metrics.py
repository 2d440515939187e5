"""Prometheus metrics of one Manager, read from its stats snapshot at scrape time.

Owns :class:`ManagerCollector` (a prometheus-client custom collector) and :func:`build_registry`. Every
scrape takes one :meth:`Manager.stats() <orbitkv_fs.manager.Manager.stats>` snapshot (and the peer layer's
:class:`~orbitkv_fs.peers.PeerStats` when peer sharing is on) and turns it into metric families, so
``/metrics`` and ``/v1/stats`` always report the same facts and nothing is double-counted.

Naming: ``orbitkv_`` prefix, units in names (``_bytes``, ``_seconds``), counters end in ``_total``.
Tier labels: ``dram``, the lower tier's name (``ssd``), ``peer``. A *miss in a tier* is a segment that tier could not serve and that fell through to the next one (DRAM,
then the lower tier, then peers); the misses of the last tier present are the segments no tier had. SSD residency is
``orbitkv_ssd_objects`` / ``orbitkv_ssd_live_bytes`` (the SSD index does not split it by representation). The lower tier's own flat stats (``ssd_*``) are exported as
``orbitkv_ssd_*``: names ending in ``_total`` as counters, others as gauges, the backend as an info label.
The data plane's limits and the times they bit (:class:`~orbitkv_fs.dataplane.DataPlaneStats`) are
``orbitkv_dataplane_*``; the control plane's own (:class:`~.connections.HttpConnectionStats`) ``orbitkv_http_*``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from orbitkv_fs.histogram import DURATION_BUCKETS_S
from orbitkv_fs.manager import ManagerStats
from orbitkv_fs.segment import Format, RawReason

__all__ = ["ManagerCollector", "build_registry"]

_P = "orbitkv_"
_REPRESENTATIONS = tuple(f.name.lower() for f in Format)
_RAW_REASONS = tuple(r.name.lower() for r in RawReason if r != RawReason.NONE)


def _counter(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
             rows: dict[tuple[str, ...], float] | None = None) -> CounterMetricFamily:
    m = CounterMetricFamily(_P + name, doc, value=value, labels=labels)
    for lv, v in (rows or {}).items():
        m.add_metric(list(lv), v)
    return m


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
           rows: dict[tuple[str, ...], float] | None = None) -> GaugeMetricFamily:
    m = GaugeMetricFamily(_P + name, doc, value=value, labels=labels)
    for lv, v in (rows or {}).items():
        m.add_metric(list(lv), v)
    return m


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float) -> Metric:
    """``counts`` per bound then +Inf, not cumulative (as the snapshots keep them)."""
    buckets, acc = [], 0
    for bound, n in zip(list(bounds) + [float("inf")], counts):
        acc += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
    return HistogramMetricFamily(_P + name, doc, buckets=buckets, sum_value=total)


class ManagerCollector(Collector):
    """Collects a Manager's metrics at scrape time. ``peer_stats`` returns the peer layer's snapshot
    (or None when peer sharing is off)."""

    def __init__(self, manager: Any, peer_stats: Callable[[], Any | None] | None = None,
                 dataplane_stats: Callable[[], Any] | None = None,
                 http_stats: Callable[[], Any] | None = None, lower_wanted: str | None = None) -> None:
        self._manager = manager
        self._lower_wanted = lower_wanted
        self._peer_stats = peer_stats
        self._dataplane_stats = dataplane_stats
        self._http_stats = http_stats

    def describe(self) -> list[Metric]:
        # Families depend on the snapshot (tiers, reasons); an empty describe keeps registration cheap.
        return []

    def collect(self) -> Iterator[Metric]:
        s: ManagerStats = self._manager.stats()
        lower = getattr(self._manager, "lower", None)
        peers = self._peer_stats() if self._peer_stats is not None else None
        yield from self._manager_families(s, getattr(lower, "name", "lower") if lower is not None else None,
                                          peers is not None or getattr(self._manager, "peers", None) is not None)
        if self._lower_wanted is not None:
            yield _gauge("lower_tier_missing", "1 while the lower tier the flags asked for does not serve: its start "
                         "was given up (--ssd-start-timeout); restart the manager once the disk answers",
                         labels=["tier"], rows={(self._lower_wanted,): float(lower is None)})
        yield from self._lower_families(s.lower)
        if peers is not None:
            yield from self._peer_families(peers)
        if self._dataplane_stats is not None:
            yield from self._dataplane_families(self._dataplane_stats())
        if self._http_stats is not None:
            yield from self._http_families(self._http_stats())

    # -- the Manager ------------------------------------------------------------------------------------

    def _manager_families(self, s: ManagerStats, lower: str | None, has_peers: bool) -> Iterator[Metric]:
        yield _gauge("engines", "registered engines", s.engines)
        yield _counter("engines_reaped", "engines unregistered by the Manager because their process exited",
                       s.engines_reaped)
        yield _counter("pages_files_reclaimed", "engine pages files (staging areas, CPU engines' KV) of killed "
                       "processes that the Manager removed from its shared-memory directory", s.pages_files_reclaimed)
        yield _counter("registrations_refused", "registrations refused over their OS user's quota of engines or "
                       "tensors (--max-engines-per-user, --max-tensors-per-user)", s.registrations_refused)
        yield _counter("engines_pages_lost", "engines whose pages file shrank under the Manager's mapping (its "
                       "owner truncated it); their calls are refused until they register again", s.pages_lost)
        yield _counter("leases_expired", "lookup and peer leases dropped after --lease-ttl without a restore or "
                       "release", s.leases_expired)
        yield _counter("leases_displaced", "lookup leases ended early because their engine held "
                       "--max-leases-per-engine leases or --max-leased-chunks-per-engine chunks under them",
                       s.leases_displaced)
        yield _counter("leases_refused", "lookups answered without a lease because their run alone was over "
                       "--max-leased-chunks-per-engine", s.leases_refused)
        yield _counter("pinned_evictions", "segments evicted although a lookup's lease pinned their chunk: pins "
                       "held more than --max-pinned-share of the pool", s.pinned_evictions)
        yield _gauge("pool_capacity_bytes", "DRAM arena size", s.pool_capacity_bytes)
        yield _gauge("pool_used_bytes", "DRAM arena bytes allocated (published or reserved)", s.pool_used_bytes)
        yield _gauge("pool_private_bytes", "DRAM pool bytes the shm directory could not back when first written "
                     "(--no-reserve-pool, the directory full): private memory of the Manager since",
                     s.pool_private_bytes)
        yield _gauge("resident_objects", "cached objects per tier", labels=["tier"],
                     rows={(t,): n for t, n in s.resident_objects.items()})
        # Every known label value is exported (0 until it happens), so rates and alerts see the series.
        rows = {(t, rep): 0 for t in s.resident_bytes for rep in _REPRESENTATIONS}
        rows.update({(t, rep): b for t, reps in s.resident_bytes.items() for rep, b in reps.items()})
        yield _gauge("resident_bytes", "cached bytes (stored size) per tier and representation",
                     labels=["tier", "representation"], rows=rows)
        yield _gauge("resident_logical_bytes", "DRAM objects at their original (decoded) size",
                     s.resident_logical_bytes)
        # The Manager counts the lower tier as "lower"; the label is the tier's own name (ssd).
        tiers = [("dram", "dram")] + ([("lower", lower)] if lower else []) + ([("peer", "peer")] if has_peers else [])
        hits = {(label,): float(s.hits.get(key, 0)) for key, label in tiers}
        # A segment missed in a tier is one a later tier served, or that no tier had.
        misses, fell = {}, float(s.misses)
        for _, label in reversed(tiers):
            misses[(label,)] = fell
            fell += hits[(label,)]
        misses = {(label,): misses[(label,)] for _, label in tiers}
        yield _counter("hits", "segments served, per tier", labels=["tier"], rows=hits)
        yield _counter("misses", "segments a tier could not serve (fell through to the next tier, or missed)",
                       labels=["tier"], rows=misses)
        yield _counter("lookups", "lookup requests", s.lookups)
        yield _counter("lookup_chunks_hit", "chunks lookups found present (leading runs)", s.lookup_chunks_hit)
        yield _counter("evictions", "objects evicted from DRAM", s.evictions)
        yield _counter("evicted_bytes", "stored bytes evicted from DRAM", s.evicted_bytes)
        yield _counter("demoted_objects", "evicted objects the lower tier took", s.demoted)
        yield _counter("save_requests", "save requests", s.save_requests)
        yield _counter("save_logical_bytes", "source bytes of admitted segments", s.save_logical_bytes)
        yield _counter("save_stored_bytes", "segment bytes (header + payload) admitted", s.save_stored_bytes)
        yield _counter("restore_requests", "restore requests", s.restore_requests)
        yield _counter("restore_logical_bytes", "decoded bytes written to engine pages", s.restore_logical_bytes)
        yield _counter("restore_stored_bytes", "segment bytes read for restores", s.restore_stored_bytes)
        docs = {"save": "save request duration", "restore": "restore request duration",
                "encode": "codec batch encode duration", "decode": "segment decode duration"}
        for name, h in s.durations.items():
            yield _histogram(f"{name}_duration_seconds", docs.get(name, f"{name} duration"), DURATION_BUCKETS_S,
                             h.buckets, h.sum)
        yield _counter("codec_batches", "codec batches encoded", s.codec_batches)
        yield _counter("codec_segments", "segments stored, per representation", labels=["representation"],
                       rows={**{(r,): 0 for r in _REPRESENTATIONS}, **{(r,): n for r, n in s.codec_segments.items()}})
        yield _counter("raw_segments", "segments stored raw although a codec was asked, per reason",
                       labels=["reason"],
                       rows={**{(r,): 0 for r in _RAW_REASONS}, **{(r,): n for r, n in s.raw_segments.items()}})
        yield _counter("decode_failures", "segments that failed validation or decode (served as misses)",
                       s.decode_failures)
        yield _counter("dropped_segments", "segments neither DRAM nor the lower tier took", s.dropped_segments)
        yield _gauge("reserved_bytes", "arena bytes reserved, not yet published", s.reserved_bytes)
        yield _gauge("leases_active", "lookup and peer leases handed out and not ended", s.leases_active)
        yield _gauge("pinned_chunks", "chunks pinned in DRAM by lookup leases", s.pinned_chunks)
        yield _gauge("leased_bytes", "bytes of segments leased one by one (restores in progress, peers); lookup "
                     "pins are in orbitkv_pinned_chunks", s.leased_bytes)
        yield _gauge("workspace_bytes", "codec workspace in use", s.workspace_bytes)
        # The GPU codec engine's own workspace and batches (zero without a GPU engine).
        yield _gauge("gpu_codec_workspace_bytes", "device workspace the GPU codec engine retains",
                     s.gpu_workspace_bytes)
        yield _counter("gpu_codec_workspace_grows", "GPU codec workspace (re)allocations to grow",
                       s.gpu_workspace_grows)
        for field, name, doc in (("gpu_batches", "gpu_codec_batches", "GPU codec batches, per worker"),
                                 ("gpu_segments", "gpu_codec_segments", "segments coded in GPU batches, per worker"),
                                 ("gpu_cpu_fallbacks", "gpu_codec_cpu_fallbacks",
                                  "segments the GPU engine coded on the host (over its workspace), per worker")):
            rows = {(w,): 0 for w in ("save", "restore")}
            rows.update({(w,): n for w, n in getattr(s, field).items()})
            yield _counter(name, doc, labels=["worker"], rows=rows)
        rows = {(w,): 0.0 for w in ("save", "restore")}
        rows.update({(w,): v for w, v in s.gpu_wait_seconds.items()})
        yield _counter("gpu_codec_wait_seconds", "seconds the host waited on the GPU codec engine's streams, per "
                       "worker (the rest of a batch's host time is its own work)", labels=["worker"], rows=rows)
        yield _gauge("inflight_requests", "data-path requests in progress", s.inflight_requests)
        yield _counter("prefetch_segments", "segments speculatively read from the SSD into DRAM", s.prefetch_segments)
        yield _counter("prefetch_bytes", "segment bytes speculatively read from the SSD into DRAM", s.prefetch_bytes)
        yield _counter("prefetch_hits", "prefetched objects later served", s.prefetch_hits)
        yield _counter("prefetch_wasted", "prefetched objects that left DRAM unserved", s.prefetch_wasted)
        yield _counter("ssd_direct_writes", "segments saves wrote from GPU memory straight to the SSD (cuFile)",
                       s.ssd_direct_writes)
        yield _counter("ssd_direct_reads", "segments restores read from the SSD into GPU memory and decoded there "
                       "(cuFile)", s.ssd_direct_reads)

    # -- the lower tier ---------------------------------------------------------------------------------

    def _lower_families(self, stats: dict[str, float]) -> Iterator[Metric]:
        backends = [k for k in stats if k.startswith("ssd_backend_")]
        if backends:
            yield _gauge("ssd_backend_info", "the SSD tier's I/O backend", labels=["backend"],
                         rows={(k.removeprefix("ssd_backend_"),): stats[k] for k in backends})
        for name in sorted(k for k in stats if k not in backends):
            if not _valid_name(name):
                continue
            doc = f"lower tier: {name}"
            if name.endswith("_total"):
                yield _counter(name.removesuffix("_total"), doc, stats[name])
            else:
                yield _gauge(name, doc, stats[name])

    # -- the data plane -----------------------------------------------------------------------------------

    def _dataplane_families(self, d: Any) -> Iterator[Metric]:
        yield _gauge("dataplane_connections", "data-plane connections open", d.connections)
        yield _gauge("dataplane_engine_connections", "data-plane connections that acted for a registered engine "
                     "(never displaced)", d.engine_connections)
        yield _gauge("dataplane_buffered_bytes", "bytes of data-plane messages held (received or being answered)",
                     d.buffered_bytes)
        yield _gauge("dataplane_max_connections", "--data-plane-max-connections", d.max_connections)
        yield _gauge("dataplane_max_buffered_bytes", "--data-plane-max-buffered", d.max_buffered_bytes)
        yield _gauge("dataplane_message_timeout_seconds", "--data-plane-message-timeout", d.message_timeout_s)
        yield _counter("dataplane_connections_refused", "connections refused with a ZMTP ERROR: every slot an "
                       "engine's or answering a request", d.connections_refused_total)
        yield _counter("dataplane_connections_displaced", "anonymous connections closed to make room for a new one",
                       d.connections_displaced_total)
        yield _counter("dataplane_message_timeouts", "handshakes and messages cut off at the message deadline",
                       d.message_timeouts_total)
        yield _counter("dataplane_buffer_refusals", "messages dropped and answered DataPlaneBusy for the buffer "
                       "bound", d.buffer_refusals_total)
        yield _counter("dataplane_auth_failures", "engine calls without their engine's credential, admin acts "
                       "without the admin token", d.auth_failures_total)

    # -- the control plane's connections ----------------------------------------------------------------

    def _http_families(self, h: Any) -> Iterator[Metric]:
        yield _gauge("http_connections", "control-plane (HTTP) connections open", h.connections)
        yield _gauge("http_max_connections", "--http-max-connections", h.max_connections)
        yield _gauge("http_request_timeout_seconds", "--http-request-timeout", h.request_timeout_s)
        yield _counter("http_connections_displaced", "idle or unfinished HTTP connections closed to make room for a "
                       "new one", h.connections_displaced_total)
        yield _counter("http_connections_refused", "HTTP connections answered 503 busy: every connection was "
                       "answering a request", h.connections_refused_total)
        yield _counter("http_request_timeouts", "HTTP connections closed because a request did not arrive in full, "
                       "or its answer was not taken, within --http-request-timeout", h.request_timeouts_total)

    # -- peers --------------------------------------------------------------------------------------------

    def _peer_families(self, p: Any) -> Iterator[Metric]:
        for f in ("lookups_total", "keys_requested_total", "keys_fetched_total", "fetched_bytes_total",
                  "misses_total", "served_lease_requests_total", "served_keys_requested_total",
                  "served_keys_total", "served_bytes_total", "served_leases_expired_total"):
            yield _counter("peer_" + f.removesuffix("_total"), f"peer layer: {f}", getattr(p, f))
        yield _counter("peer_fetch_seconds", "time spent fetching from peers", p.fetch_seconds_total)
        yield _counter("peer_failures", "peer fetch failures, per reason", labels=["reason"],
                       rows={(r,): n for r, n in p.failures_total.items()})
        yield _counter("peer_served_refusals", "peer requests this Manager refused, per reason", labels=["reason"],
                       rows={(r,): n for r, n in p.served_refusals_total.items()})
        yield _histogram("peer_hit_latency_seconds", "remote-hit latency", DURATION_BUCKETS_S,
                         p.hit_latency.buckets, p.hit_latency.sum)
        yield _gauge("peer_staging_bytes", "staging memory for peer reads", p.staging_bytes)
        yield _gauge("peer_staging_used_bytes", "staging memory in use", p.staging_used_bytes)
        yield _gauge("peer_served_leases_active", "leases held for peers", p.served_leases_active)
        yield _gauge("peer_served_connections", "connections open at the peer port", p.served_connections)
        yield _counter("peer_served_connections_closed", "peer-port connections shut down past "
                       "--peer-max-connections (the oldest that never carried a valid request first)",
                       p.served_connections_closed_total)
        yield _gauge("peer_abandoned_reads", "peer reads given up at the deadline, still in flight",
                     p.abandoned_reads)
        yield _gauge("peers", "configured peers, per state", labels=["state"],
                     rows={(st,): sum(1 for x in p.peers if x.state == st) for st in {x.state for x in p.peers}})


def _valid_name(name: str) -> bool:
    return bool(name) and (name[0].isalpha() or name[0] == "_") and all(c.isalnum() or c == "_" for c in name)


def build_registry(manager: Any, peer_stats: Callable[[], Any | None] | None = None,
                   dataplane_stats: Callable[[], Any] | None = None,
                   http_stats: Callable[[], Any] | None = None, lower_wanted: str | None = None) -> CollectorRegistry:
    """A registry of its own (never the process-global one) holding the Manager's collector. ``lower_wanted``: the
    lower tier the flags asked for (``orbitkv_lower_tier_missing`` says whether it serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ManagerCollector(manager, peer_stats, dataplane_stats, http_stats, lower_wanted))
    return registry
