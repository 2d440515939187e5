"""The CUDA module of the codec kernels and the constants shared with it.

Owns: compiling ``kernels/*.cu`` with CuPy's RawModule (once per process, device and variant), the
device copies of the constant tables (:mod:`orbitkv_fs.gpu.tables`), the descriptor layouts
(:data:`SEG_DTYPE`, :data:`META_DTYPE`) and :func:`launch`, which every launch goes through so that
launches are counted.

Invariants: the sources are built with ``-fmad=false`` (no fused multiply-add anywhere: the codecs'
float32 operations are rounded one by one, as on the host); :data:`SEG_DTYPE` matches ``struct Seg``
of ``kernels/common.cuh`` byte for byte (field offsets and the 128-byte size).
"""

from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass

import cupy as cp
import numpy as np

from orbitkv_fs.pages import BLOCK_COPY_DTYPE  # noqa: F401  (re-exported: the kernel's table rows)

from .tables import CHUNK, THREADS, crc_tables, turboquant_tables

SOURCES = ("common.cuh", "crc32c.cu", "fp8.cu", "turboquant.cu", "ans.cu", "blocks.cu")
OPTIONS = ("--std=c++17", "--fmad=false")
KERNEL_NAMES = ("okv_crc32c", "okv_copy_checked", "okv_fp8_encode", "okv_fp8_decode", "okv_tq_encode", "okv_tq_decode",
                "okv_ans_pack", "okv_copy_blocks")

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
META_DTYPE = np.dtype([("acc", "<u4"), ("status", "<u4"), ("pad0", "<u4"), ("pad1", "<u4")])
TQ_VECTORS_PER_UNIT = 16384  # divided by head_dim: 32 KiB of 16-bit source per work unit


def source() -> str:
    root = importlib.resources.files("orbitkv_fs.gpu") / "kernels"
    return "\n".join((root / name).read_text() for name in SOURCES)


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
    grids: dict[str, int]  # resident blocks of each kernel on the whole device
    hardware_fp8: bool

    def fn(self, name: str) -> cp.RawKernel:
        return self.functions[name]


def _resident_blocks(fn: cp.RawKernel, props: dict) -> int:
    """Blocks of ``fn`` (THREADS threads) one multiprocessor holds at once: the kernels loop over their
    work units, so the grid must be exactly what fits -- a larger one runs its last blocks after the
    first ones finished all their units, doubling the time."""
    attrs = fn.attributes
    regs = max(int(attrs.get("num_regs", 32)), 1)
    per_warp = -(-regs * 32 // 256) * 256
    warps = THREADS // 32
    by_regs = int(props.get("regsPerMultiprocessor", 65536)) // (per_warp * warps)
    by_threads = int(props.get("maxThreadsPerMultiProcessor", 2048)) // THREADS
    smem = int(attrs.get("shared_size_bytes", 0)) + int(props.get("reservedSharedMemPerBlock", 1024))
    by_smem = int(props.get("sharedMemPerMultiprocessor", 233472)) // max(smem, 1)
    return max(1, min(by_regs, by_threads, by_smem, 32))


@functools.cache
def _kernels(device_id: int, arith: bool) -> Kernels:
    with cp.cuda.Device(device_id):
        options = OPTIONS + (("-DOKV_FP8_ARITH",) if arith else ())
        mod = cp.RawModule(code=source(), options=options)
        functions = {name: mod.get_function(name) for name in KERNEL_NAMES}
        props = cp.cuda.runtime.getDeviceProperties(device_id)
        sms = int(props["multiProcessorCount"])
        major, minor = int(props["major"]), int(props["minor"])
        return Kernels(
            module=mod,
            functions=functions,
            crc_tables=cp.asarray(crc_tables()),
            tq_tables=cp.asarray(turboquant_tables()),
            grids={name: sms * _resident_blocks(fn, props) for name, fn in functions.items()},
            hardware_fp8=(not arith) and (major, minor) >= (8, 9),
        )


def kernels(arith: bool = False) -> Kernels:
    """The kernels of the current device; ``arith`` builds the variant without FP8 instructions."""
    return _kernels(cp.cuda.Device().id, arith)


def launch_copy_blocks(k: Kernels, table_ptr: int, n: int, stream: cp.cuda.Stream) -> int:
    """Launch ``okv_copy_blocks`` over ``n`` table rows at device address ``table_ptr``; returns launches made."""
    if n <= 0:
        return 0
    k.fn("okv_copy_blocks")((min(n, k.grids["okv_copy_blocks"]),), (THREADS,), (np.uint64(table_ptr), np.uint32(n)),
                            stream=stream)
    return 1


def launch(k: Kernels, name: str, segs_ptr: int, nsegs: int, total: int, meta_ptr: int, stream: cp.cuda.Stream,
           table: "cp.ndarray | None" = None) -> int:
    """Launch kernel ``name`` over ``total`` work units of ``nsegs`` descriptors; returns 1 (launches made)."""
    if total <= 0:
        return 0
    args = [np.uint64(segs_ptr), np.int32(nsegs), np.uint32(total), np.uint64(meta_ptr)]
    if table is not None:
        args.append(table)
    grid = min(total, k.grids[name])
    k.fn(name)((grid,), (THREADS,), tuple(args), stream=stream)
    return 1
