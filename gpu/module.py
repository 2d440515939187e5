"""The CUDA module of the codec kernels and the constants shared with it.

Owns: compiling ``kernels/*.cu`` with NVRTC (once per process, device and variant; the image cached on
disk), the device copies of the constant tables (:mod:`orbitkv_fs.gpu.tables`), the descriptor layouts
(:data:`SEG_DTYPE`, :data:`META_DTYPE`) and :func:`launch` (with :func:`launch_copy_blocks`,
:func:`launch_ans_place`), which every launch goes through so that launches are counted. Launches go
straight to the driver (``cuLaunchKernel``, :class:`_Launcher`), not through a cupy ``RawKernel`` call.

Invariants: the sources are built with ``-fmad=false`` (no fused multiply-add anywhere: the codecs'
float32 operations are rounded one by one, as on the host) and ``-ftz=false`` (subnormal float32 results
kept, as on the host: CuPy's ``RawModule(code=...)`` appends ``-ftz=true``, cupy#9576, so
:func:`build_module` calls NVRTC itself); :data:`SEG_DTYPE` matches ``struct Seg`` of
``kernels/common.cuh`` byte for byte (field offsets and the 128-byte size).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import tempfile
import threading
from dataclasses import dataclass

import cupy as cp
import numpy as np
from cupy_backends.cuda.api import driver as _driver

from orbitkv_fs.errors import CodecUnavailable
from orbitkv_fs.pages import BLOCK_COPY_DTYPE  # noqa: F401  (re-exported: the kernel's table rows)
from orbitkv_fs.segment import header_crc_tables

from .headers import HEADER_ROW_DTYPE  # noqa: F401  (re-exported: okv_write_headers' rows)

from .tables import CHUNK, THREADS, crc_tables, turboquant_tables

SOURCES = ("common.cuh", "crc32c.cu", "fp8.cu", "turboquant.cu", "ans.cu", "blocks.cu", "headers.cu")
# One of okv_tq_encode_k's two pass buffers per warp (OKV_TQ_KBUF): 64 elements a lane x 32 lanes x 2 bytes,
# plus 16 bytes per row of padding.
TQ_K_BUFFER = 64 * 64 + 512
OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", f"-DOKV_TQ_KBUF={TQ_K_BUFFER}")
KERNEL_NAMES = ("okv_crc32c", "okv_copy_checked", "okv_fp8_encode", "okv_fp8_decode", "okv_tq_encode_k", "okv_tq_encode_v",
                "okv_tq_decode",
                "okv_ans_place", "okv_ans_pack", "okv_copy_blocks", "okv_write_headers")

# Dynamic shared memory of a kernel, bytes: okv_tq_encode_k's two pass buffers per warp, above the 48 KiB
# a kernel may hold statically.
DYNAMIC_SMEM = {"okv_tq_encode_k": THREADS // 32 * 2 * TQ_K_BUFFER}

ST_RANGE = 1
ST_NONFINITE = 2
ST_ANS_FAILED = 4
ST_ANS_LARGE = 8

SEG_DTYPE = np.dtype(
    {
        "names": ["src", "dst", "n", "n_dev", "block0", "nblocks", "meta", "dtype", "head_dim", "bits", "role",
                  "expect_crc", "signs", "st_dev"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", ("<u4", 8),
                    "<u8"],
        "offsets": [0, 8, 16, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64, 96],
        "itemsize": 128,
    }
)
assert SEG_DTYPE.itemsize == 128 and SEG_DTYPE.fields["st_dev"][1] == 96
META_DTYPE = np.dtype([("acc", "<u4"), ("status", "<u4"), ("pad0", "<u4"), ("pad1", "<u4")])
TQ_VECTORS_PER_UNIT = 16384  # divided by head_dim: 32 KiB of 16-bit source per work unit


def source() -> str:
    root = importlib.resources.files("orbitkv_fs.gpu") / "kernels"
    return "\n".join((root / name).read_text() for name in SOURCES)


def _cache_dir() -> str:
    root = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return os.path.join(root, "orbitkv_fs")


def build_module(code: str, options: tuple[str, ...]) -> cp.RawModule:
    """Compile ``code`` for the current device with NVRTC under exactly ``options`` and load it.

    CuPy's ``RawModule(code=...)`` adds ``-ftz=true`` to every NVRTC build, which flushes subnormal float32
    results (e.g. squares of BF16 keys below 2^-63) to zero where the host codecs keep them; this path adds
    only the target architecture. The image is cached under CuPy's cache directory, keyed by the source,
    options, device architecture and NVRTC and CuPy versions (a build takes seconds).
    """
    from cupy.cuda import compiler
    from cupy_backends.cuda.libs import nvrtc

    arch = str(cp.cuda.Device().compute_capability)
    key = "\0".join([code, *options, arch, repr(nvrtc.getVersion()), cp.__version__])
    path = os.path.join(_cache_dir(), hashlib.sha256(key.encode()).hexdigest() + ".bin")
    if not os.path.isfile(path):
        image, _ = compiler.compile_using_nvrtc(code, options, cache_in_memory=True)
        if isinstance(image, str):  # PTX where NVRTC cannot target the device's architecture
            image = image.encode()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, path)  # concurrent builders write the same bytes; the last rename wins
    return cp.RawModule(path=path)


def units_bytes(n: int) -> int:
    """Work units of the CRC and copy kernels for ``n`` bytes."""
    return -(-n // CHUNK)


def units_fp8(n_source_bytes: int) -> int:
    return -(-(n_source_bytes // 2) // CHUNK)


def units_tq(n_source_bytes: int, head_dim: int) -> int:
    vectors = n_source_bytes // (2 * head_dim)
    return -(-vectors // (TQ_VECTORS_PER_UNIT // head_dim))


@dataclass
class Kernels:
    """The compiled functions and constant tables of one device."""

    module: cp.RawModule
    functions: dict[str, cp.RawKernel]
    crc_tables: cp.ndarray
    tq_tables: cp.ndarray
    header_tables: cp.ndarray  # segment.header_crc_tables': payload-CRC then stored-length tables, (8, 256) uint32
    grids: dict[str, int]  # resident blocks of each kernel on the whole device
    hardware_fp8: bool

    def fn(self, name: str) -> cp.RawKernel:
        return self.functions[name]


MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, and okv_tq_encode_k's shared memory beyond 64 KiB per block


def check_device(props: "dict | None" = None) -> None:
    """Raise :class:`CodecUnavailable` when the current GPU (or ``props``, its cudaDeviceProp fields) cannot
    run the kernels: compute capability below 8.0, or less opt-in shared memory per block than the K
    encode's two pass buffers per warp and its tables."""
    if props is None:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    cc = (int(props["major"]), int(props["minor"]))
    need = DYNAMIC_SMEM["okv_tq_encode_k"] + (8 << 10)
    optin = int(props.get("sharedMemPerBlockOptin", need))
    if cc < MIN_COMPUTE_CAPABILITY or optin < need:
        raise CodecUnavailable(f"the GPU codec kernels need compute capability 8.0 and {need} bytes of shared memory "
                               f"per block; this GPU has {cc[0]}.{cc[1]} and {optin}")


def load_functions(mod: cp.RawModule, names: "tuple[str, ...]") -> dict[str, cp.RawKernel]:
    """The module's functions, each allowed the dynamic shared memory it launches with."""
    functions = {name: mod.get_function(name) for name in names}
    for name, nbytes in DYNAMIC_SMEM.items():
        if name in functions:
            functions[name].max_dynamic_shared_size_bytes = nbytes
    return functions


def _resident_blocks(fn: cp.RawKernel, props: dict, dynamic: int = 0) -> int:
    """Blocks of ``fn`` (THREADS threads) one multiprocessor holds at once: the kernels loop over their
    work units, so the grid must be exactly what fits -- a larger one runs its last blocks after the
    first ones finished all their units, doubling the time."""
    attrs = fn.attributes
    regs = max(int(attrs.get("num_regs", 32)), 1)
    per_warp = -(-regs * 32 // 256) * 256
    warps = THREADS // 32
    by_regs = int(props.get("regsPerMultiprocessor", 65536)) // (per_warp * warps)
    by_threads = int(props.get("maxThreadsPerMultiProcessor", 2048)) // THREADS
    smem = int(attrs.get("shared_size_bytes", 0)) + dynamic + int(props.get("reservedSharedMemPerBlock", 1024))
    by_smem = int(props.get("sharedMemPerMultiprocessor", 233472)) // max(smem, 1)
    return max(1, min(by_regs, by_threads, by_smem, 32))


@functools.cache
def _kernels(device_id: int, arith: bool) -> Kernels:
    with cp.cuda.Device(device_id):
        check_device()
        options = OPTIONS + (("-DOKV_FP8_ARITH",) if arith else ())
        mod = build_module(source(), options)
        functions = load_functions(mod, KERNEL_NAMES)
        props = cp.cuda.runtime.getDeviceProperties(device_id)
        sms = int(props["multiProcessorCount"])
        major, minor = int(props["major"]), int(props["minor"])
        return Kernels(
            module=mod,
            functions=functions,
            crc_tables=cp.asarray(crc_tables()),
            tq_tables=cp.asarray(turboquant_tables()),
            header_tables=cp.asarray(np.concatenate(header_crc_tables()).astype(np.uint32)),
            grids={name: sms * _resident_blocks(fn, props, DYNAMIC_SMEM.get(name, 0)) for name, fn in functions.items()},
            hardware_fp8=(not arith) and (major, minor) >= (8, 9),
        )


def kernels(arith: bool = False) -> Kernels:
    """The kernels of the current device; ``arith`` builds the variant without FP8 instructions."""
    return _kernels(cp.cuda.Device().id, arith)


class _Launcher:
    """Kernel launches of one thread, straight through the driver (``cuLaunchKernel``): each argument written
    into an 8-byte slot of a buffer of the launcher's own (a 4-byte one in the slot's low half, little-endian),
    the function handles looked up once. A cupy ``RawKernel`` call boxes and checks its arguments, 30-35 us of
    host time per launch on the H200's host (docs/results/2026-12-03-flight-host); this is one driver call. The
    driver copies the arguments at the call, so the buffer is free again on return; one per thread (the save
    and restore workers launch under different locks)."""

    def __init__(self, k: Kernels) -> None:
        # The driver launches in the thread's current context; a runtime call makes the device's primary
        # context current (cudaFree(0): the usual no-op for it), as a cupy launch would have.
        cp.cuda.runtime.free(0)
        self.fn = {name: int(f.kernel.ptr) for name, f in k.functions.items()}
        self.args = np.zeros(8, dtype=np.uint64)
        base = self.args.ctypes.data
        self._ptrs = np.arange(base, base + 8 * len(self.args), 8, dtype=np.uint64)  # kernelParams: one per slot
        self.params = self._ptrs.ctypes.data

    def go(self, name: str, grid: int, smem: int, stream: cp.cuda.Stream, *args: int) -> None:
        self.args[:len(args)] = args
        _driver.launchKernel(self.fn[name], grid, 1, 1, THREADS, 1, 1, smem, stream.ptr, self.params, 0)


_LOCAL = threading.local()


def _launcher(k: Kernels) -> _Launcher:
    """This thread's launcher of ``k`` 's functions (Kernels live as long as the process: a cached build)."""
    got = getattr(_LOCAL, "launchers", None)
    if got is None:
        got = _LOCAL.launchers = {}
    lau = got.get(id(k))
    if lau is None:
        lau = got[id(k)] = _Launcher(k)
    return lau


def launch_copy_blocks(k: Kernels, table_ptr: int, n: int, stream: cp.cuda.Stream) -> int:
    """Launch ``okv_copy_blocks`` over ``n`` table rows at device address ``table_ptr``; returns launches made."""
    if n <= 0:
        return 0
    _launcher(k).go("okv_copy_blocks", min(n, k.grids["okv_copy_blocks"]), 0, stream, table_ptr, n)
    return 1


def launch(k: Kernels, name: str, segs_ptr: int, nsegs: int, total: int, meta_ptr: int, stream: cp.cuda.Stream,
           table: "cp.ndarray | None" = None) -> int:
    """Launch kernel ``name`` over ``total`` work units of ``nsegs`` descriptors (its arguments: the descriptors,
    their count, the work units, the metadata, and ``table`` 's address where given); returns 1 (launches made)."""
    if total <= 0:
        return 0
    lau, grid, smem = _launcher(k), min(total, k.grids[name]), DYNAMIC_SMEM.get(name, 0)
    if table is None:
        lau.go(name, grid, smem, stream, segs_ptr, nsegs, total, meta_ptr)
    else:
        lau.go(name, grid, smem, stream, segs_ptr, nsegs, total, meta_ptr, table.data.ptr)
    return 1


def launch_write_headers(k: Kernels, rows_ptr: int, n: int, region: int, templates_ptr: int, bases_ptr: int,
                         stream: cp.cuda.Stream) -> int:
    """Launch ``okv_write_headers`` over ``n`` :data:`HEADER_ROW_DTYPE` rows at device address ``rows_ptr``:
    each row's header written into the output region at ``region`` (its Meta array first) from the templates
    (``(t, 64)`` bytes) and their header CRCs (``bases``, uint32) at those device addresses; returns launches
    made."""
    if n <= 0:
        return 0
    grid = min(-(-n // THREADS), k.grids["okv_write_headers"])
    _launcher(k).go("okv_write_headers", grid, 0, stream, rows_ptr, n, region, templates_ptr, bases_ptr,
                    k.header_tables.data.ptr, k.crc_tables.data.ptr)
    return 1


def launch_ans_place(k: Kernels, segs_ptr: int, nsegs: int, ans0: int, align: int, carry: int,
                     stream: cp.cuda.Stream) -> int:
    """Launch ``okv_ans_place`` (one block) over the ``nsegs`` ANS packing rows at ``segs_ptr``: their packed
    slots from device address ``ans0`` plus the u64 at device address ``carry`` (the bytes earlier rounds of
    the batch placed; advanced past this round's), each rounded up to ``align``; returns launches made."""
    if nsegs <= 0:
        return 0
    _launcher(k).go("okv_ans_place", 1, 0, stream, segs_ptr, nsegs, ans0, align, carry)
    return 1
