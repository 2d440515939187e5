"""The Manager's counters, gauges and duration histograms, and the :class:`ManagerStats` snapshot.

Primitives: :meth:`Counters._add` (counters; ``*_seconds`` also observe their histogram),
:meth:`Counters._add_per_segment`, :meth:`Counters._count` (per-name tables: hits, representations, raw
reasons), :meth:`Counters._workspace_delta`, :meth:`Counters.stats`.

State owned: ``_stat_lock``, ``_c``, ``_hits``, ``_codec_segments``, ``_raw``, ``_workspace``,
``_durations``, ``_cpu_stages`` (:meth:`Counters._cpu`: host CPU seconds and segments per pipeline stage). Invariants: every update takes ``_stat_lock`` once; :meth:`~Counters.stats` is one
consistent snapshot of them (DRAM's own figures under the tier's lock).
"""

from __future__ import annotations

import logging

from .api import ManagerStats
from .verify import _REP_NAMES

log = logging.getLogger("orbitkv_fs.manager")

_DURATIONS = {"save_seconds": "save", "restore_seconds": "restore", "encode_seconds": "encode",
              "decode_seconds": "decode"}


_COUNTERS = ("misses", "lookups", "lookup_chunks_hit", "save_requests", "save_logical_bytes", "save_stored_bytes",
             "save_seconds", "restore_requests", "restore_logical_bytes", "restore_stored_bytes",
             "restore_seconds", "codec_batches", "encode_seconds", "decode_seconds", "decode_failures",
             "dropped_segments", "prefetch_segments", "prefetch_bytes", "engines_reaped", "pages_files_reclaimed",
             "registrations_refused", "pages_lost", "leases_expired", "leases_displaced", "leases_refused",
             "ssd_direct_writes", "ssd_direct_reads", "restore_gpu_wait_seconds")


class Counters:
    """Counters and the :class:`ManagerStats` snapshot."""

    def _add(self, **kw: float) -> None:
        with self._stat_lock:
            for k, v in kw.items():
                self._c[k] += v
                hist = _DURATIONS.get(k)
                if hist is not None:  # every *_seconds add is one observation of that duration
                    self._durations[hist].observe(v)

    def _add_per_segment(self, key: str, seconds: float, n: int) -> None:
        """A batch's ``seconds`` under the ``*_seconds`` counter ``key``, observed by its histogram as ``n``
        segments of ``seconds / n`` each (one lock round, not one per segment)."""
        with self._stat_lock:
            self._c[key] += seconds
            self._durations[_DURATIONS[key]].observe(seconds / n, n)

    def _cpu(self, stage: str, seconds: float, segments: int) -> None:
        """``seconds`` of host CPU time spent in pipeline ``stage`` on ``segments`` segments."""
        with self._stat_lock:
            c = self._cpu_stages.get(stage)
            if c is None:
                c = self._cpu_stages[stage] = [0.0, 0]
            c[0] += seconds
            c[1] += segments

    def _count(self, table: dict[str, int], name: str, n: int = 1) -> None:
        with self._stat_lock:
            table[name] = table.get(name, 0) + n

    def _workspace_delta(self, n: int) -> None:
        with self._stat_lock:
            self._workspace += n

    def stats(self) -> ManagerStats:
        dram = self.dram
        with dram.lock:
            used = dram.used_bytes
            resident = {_REP_NAMES[r]: b for r, b in dram.resident_bytes.items() if b}
            objects = len(dram.index)
            logical = dram.resident_logical
            evictions, evicted, demoted = dram.evictions, dram.evicted_bytes, dram.demoted
            pf_hits, pf_wasted = dram.prefetch_hits, dram.prefetch_wasted
            reserved = dram.reserved_bytes
            pinned = len(dram.chunk_pins)
            pins_evicted = dram.pins_evicted
            leased = dram.leased_bytes
        private = dram.arena.private_bytes
        if private and not self._private_warned:
            self._private_warned = True
            log.warning("the pool's directory %s filled up (another process's files?): %d bytes of the pool are "
                        "private memory of the Manager now, not the arena file's; --reserve-pool allocates the "
                        "pool at start", self._config.shm_dir, private)
        lower_stats: dict[str, float] = {}
        gpu = self._gpu_codecs.stats() if self._gpu_codecs is not None else {}

        def per_worker(name: str) -> dict[str, int]:
            return {w: int(gpu.get(f"{w}_{name}", 0)) for w in ("save", "restore")} if gpu else {}

        res_objects = {"dram": objects}
        res_bytes = {"dram": resident}
        if self.lower is not None:
            lower_stats = {k: float(v) for k, v in self.lower.stats().items()}
        with self._lock:
            engines = sum(1 for e in self._engines.values() if not e.closing)
            inflight = self._inflight
            leases = len(self._leases)
        with self._stat_lock:
            c = dict(self._c)
            return ManagerStats(
                engines=engines, pool_capacity_bytes=dram.capacity, pool_used_bytes=used, pool_private_bytes=private,
                resident_objects=res_objects, resident_bytes=res_bytes, resident_logical_bytes=logical,
                hits=dict(self._hits), misses=int(c["misses"]), lookups=int(c["lookups"]),
                lookup_chunks_hit=int(c["lookup_chunks_hit"]), evictions=evictions, evicted_bytes=evicted,
                demoted=demoted, save_requests=int(c["save_requests"]),
                save_logical_bytes=int(c["save_logical_bytes"]), save_stored_bytes=int(c["save_stored_bytes"]),
                save_seconds=c["save_seconds"], restore_requests=int(c["restore_requests"]),
                restore_logical_bytes=int(c["restore_logical_bytes"]),
                restore_stored_bytes=int(c["restore_stored_bytes"]), restore_seconds=c["restore_seconds"],
                codec_batches=int(c["codec_batches"]), codec_segments=dict(self._codec_segments),
                encode_seconds=c["encode_seconds"], decode_seconds=c["decode_seconds"], raw_segments=dict(self._raw),
                decode_failures=int(c["decode_failures"]), dropped_segments=int(c["dropped_segments"]),
                reserved_bytes=reserved, leases_active=leases, leased_bytes=leased,
                workspace_bytes=self._workspace, inflight_requests=inflight, lower=lower_stats,
                durations={name: h.snapshot() for name, h in self._durations.items()},
                gpu_workspace_bytes=int(gpu.get("save_workspace_bytes", 0) + gpu.get("restore_workspace_bytes", 0)),
                gpu_workspace_grows=int(gpu.get("save_workspace_grows", 0) + gpu.get("restore_workspace_grows", 0)),
                gpu_batches=per_worker("batches"), gpu_segments=per_worker("segments"),
                gpu_cpu_fallbacks=per_worker("cpu_fallbacks"),
                gpu_wait_seconds=({"save": gpu.get("save_wait_ns", 0) / 1e9,
                                   "restore": gpu.get("restore_wait_ns", 0) / 1e9 + c["restore_gpu_wait_seconds"]}
                                  if gpu else {}),
                prefetch_segments=int(c["prefetch_segments"]), prefetch_bytes=int(c["prefetch_bytes"]),
                prefetch_hits=pf_hits, prefetch_wasted=pf_wasted, engines_reaped=int(c["engines_reaped"]),
                pages_files_reclaimed=int(c["pages_files_reclaimed"]),
                registrations_refused=int(c["registrations_refused"]), pages_lost=int(c["pages_lost"]),
                leases_expired=int(c["leases_expired"]),
                leases_displaced=int(c["leases_displaced"]), leases_refused=int(c["leases_refused"]),
                pinned_chunks=pinned, pinned_evictions=pins_evicted, ssd_direct_writes=int(c["ssd_direct_writes"]),
                ssd_direct_reads=int(c["ssd_direct_reads"]),
                host_cpu_seconds={k: v[0] for k, v in self._cpu_stages.items()},
                host_cpu_segments={k: v[1] for k, v in self._cpu_stages.items()})
