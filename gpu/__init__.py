"""GPU codec engine of OrbitKV-FS: CuPy kernels, descriptor batches, budgeted workspace, nvCOMP ANS.

Importing this package is free; its submodules need cupy and a CUDA GPU (``orbitkv_fs.gpu.tables``
needs only numpy, ``placement`` nothing). :func:`unusable_reason` says, without raising, why they cannot run
here (no cupy, no usable driver, no device), or ``None`` where they can: callers check it before they import
the engine, so a GPU-less host gets one clear sentence instead of a CUDA runtime error. Modules:

* ``engine`` -- :class:`GpuCodecEngine`, the batch API below.
* ``module`` -- compiles ``kernels/*.cu`` once per process (NVRTC, ``-fmad=false -ftz=false``).
* ``tables`` -- CRC32C and TurboQuant constant tables, and a numpy model of the GPU CRC combine.
* ``rows`` -- the kernels' descriptor rows, a kernel group at a time (numba; needs no cupy).
* ``headers`` -- a save flight's headers written into its output region (numba; needs no cupy).
* ``placement`` -- where a worker puts a new batch in its workspace beside the one in flight (no cupy).
* ``nvcomp`` -- ctypes binding of nvCOMP 5.x's batched ANS C API (``libnvcomp.so.5``).
* ``ans`` -- ``encode_host_array`` / ``decode_host_payload`` for :mod:`orbitkv_fs.codecs.ans`.
* ``bench`` -- ``run_codecs(args) -> dict`` behind ``orbitkv-bench codecs --device gpu --json``.

Batch API (for the Manager)::

    from orbitkv_fs.gpu import GpuCodecEngine, EncodeItem

    engine = GpuCodecEngine(budget_bytes=64 << 20, seed=rotation_seed)   # per process; two workers
    segments = engine.encode_batch([
        EncodeItem(k_view, "turboquant-4", "key", layer, dtype=ml_dtypes.bfloat16),  # cupy array view
        (v_view, "fp8", "value", layer, ml_dtypes.bfloat16),                          # tuples work too
    ])
    # -> list of memoryview (header + payload in pinned host memory, exactly 64 + stored_length bytes)
    #    or bytes (fallbacks); byte-identical to orbitkv_fs.codecs.encode_segment on the same data.
    errors = engine.decode_batch(segments, [k_dst, v_dst])                     # cupy destinations
    # -> list of None (decoded) or the OrbitKVError that made that segment a miss (destination untouched)
    engine.stats   # launches, h2d/d2h copies, syncs, batches, cpu/raw fallbacks, workspace size, per worker
    engine.close() # drains both streams, frees both workspaces

* Items: a C-contiguous cupy array, a codec name (``none``, ``ans``, ``fp8``, ``turboquant-4``,
  ``turboquant-3``), a role (``opaque``/``key``/``value``), a layer, and the source dtype where the
  array's own dtype is a stand-in (cupy has no bfloat16). TurboQuant takes the head dim from the
  array's last axis. Invalid items raise :class:`~orbitkv_fs.errors.CodecError`.
* ``encode_batch`` runs on the save worker, ``decode_batch`` on the restore worker; each call is
  split into batches of at most 1,024 segments that fit the workspace budget. Per batch: one H2D copy,
  one launch per kernel kind, one D2H copy (meta + payloads), one synchronisation.
* Memoryviews returned by ``encode_batch`` own their pinned buffer (shared by the batch); keep or copy
  them as needed.
* Pipelining: ``job = engine.encode_submit(items, ...)`` queues the batch and returns;
  ``engine.encode_collect(job)`` waits and answers the segments (``job.fmt``, ``original``, ``length``,
  ``reason`` and ``addr`` hold their header fields and host addresses as arrays). ``decode_submit`` / ``decode_collect`` likewise. Up to two batches per worker are in flight.
* Page blocks: ``engine.gather_blocks(table)`` / ``engine.scatter_blocks(table)`` copy whole page blocks
  (``orbitkv_fs.pages.BLOCK_COPY_DTYPE`` rows: source, destination, strides, rows, row bytes) in one launch
  on the save stream / the restore worker's scatter stream (after the caller's current stream; its sources
  complete); ``engine.block_buffer(nbytes, restore=...)`` allocates the contiguous side.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EncodeItem", "GpuCodecEngine"]


def unusable_reason() -> str | None:
    """Why the GPU engine cannot run on this host, or ``None`` where cupy sees at least one CUDA device."""
    try:
        import cupy
    except Exception as e:  # ImportError where absent; a broken install may raise anything while loading
        return f"cupy is not importable ({e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, or one older than cupy's CUDA runtime
        return f"no usable CUDA driver ({e})"
    return None if count > 0 else "no CUDA device"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
