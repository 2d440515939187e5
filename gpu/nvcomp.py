"""ctypes binding of nvCOMP 5.x's batched ANS C API (``libnvcomp.so.5``).

Owns: finding and loading the library (``ORBITKV_NVCOMP_LIBRARY``, else the
``nvidia-libnvcomp-cu13`` wheel's ``lib64``, else the loader's search path), the ABI check at load,
and thin typed wrappers of the calls the codec engine makes:

* ``nvcompBatchedANSCompressGetTempSizeAsync`` / ``...GetMaxOutputChunkSize`` / ``...CompressAsync``
* ``nvcompBatchedANSDecompressGetTempSizeAsync`` / ``...DecompressAsync``

Invariants: the option structs are the 64-byte ``nvcompBatchedANS{C,Dec}ompressOpts_t`` of nvCOMP 5
(``ans.h``: two enums, one ``uint8_t``, 55 reserved zero bytes), passed by value; every call's
``nvcompStatus_t`` is checked and turned into :class:`NvcompError`; a library that is missing, lacks
a symbol or reports a version other than 5.3 or later 5.x fails with
:class:`~orbitkv_fs.errors.CodecUnavailable` naming what was found.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

from orbitkv_fs.errors import CodecError, CodecUnavailable
from orbitkv_fs.segment import AnsType

SONAME = "libnvcomp.so.5"
SUPPORTED = ((5, 3), (6, 0))  # [min, max) of (major, minor)
MAX_CHUNK_BYTES = 1 << 24  # nvcompANSCompressionMaxAllowedChunkSize
REQUIRED_ALIGNMENT = 8

# nvcompType_t
_TYPE_CHAR = 0
_TYPE_FLOAT16 = 9
_TYPE_FLOAT8_E4M3 = 10
NVCOMP_TYPES = {AnsType.BYTES: _TYPE_CHAR, AnsType.FLOAT16: _TYPE_FLOAT16, AnsType.FP8: _TYPE_FLOAT8_E4M3}

STATUS_NAMES = {
    0: "nvcompSuccess", 10: "nvcompErrorInvalidValue", 11: "nvcompErrorNotSupported",
    12: "nvcompErrorCannotDecompress", 13: "nvcompErrorBadChecksum", 14: "nvcompErrorCannotVerifyChecksums",
    15: "nvcompErrorOutputBufferTooSmall", 16: "nvcompErrorWrongHeaderLength", 17: "nvcompErrorAlignment",
    18: "nvcompErrorChunkSizeTooLarge", 19: "nvcompErrorCannotCompress", 20: "nvcompErrorWrongInputLength",
    21: "nvcompErrorBatchSizeTooLarge", 22: "nvcompErrorSubChunkCountTooLarge",
    23: "nvcompErrorSubChunkCountTooSmall", 24: "nvcompErrorOutputBufferAlignmentTooSmall",
    1000: "nvcompErrorCudaError", 10000: "nvcompErrorInternal",
}


class NvcompError(CodecError):
    """An nvCOMP call returned a status other than nvcompSuccess."""


class CompressOpts(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 55)]


class DecompressOpts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 55)]


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


class _Alignments(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


assert ctypes.sizeof(CompressOpts) == 64 and ctypes.sizeof(DecompressOpts) == 64

_P = ctypes.c_void_p
_S = ctypes.c_size_t
_SIGNATURES = {
    "nvcompGetProperties": [ctypes.POINTER(_Properties)],
    "nvcompGetStatusString": [ctypes.c_int],
    "nvcompBatchedANSCompressGetRequiredAlignments": [CompressOpts, ctypes.POINTER(_Alignments)],
    "nvcompBatchedANSDecompressGetRequiredAlignments": [DecompressOpts, ctypes.POINTER(_Alignments)],
    "nvcompBatchedANSCompressGetTempSizeAsync": [_S, _S, CompressOpts, ctypes.POINTER(_S), _S],
    "nvcompBatchedANSCompressGetMaxOutputChunkSize": [_S, CompressOpts, ctypes.POINTER(_S)],
    "nvcompBatchedANSCompressAsync": [_P, _P, _S, _S, _P, _S, _P, _P, CompressOpts, _P, _P],
    "nvcompBatchedANSDecompressGetTempSizeAsync": [_S, _S, DecompressOpts, ctypes.POINTER(_S), _S],
    "nvcompBatchedANSDecompressAsync": [_P, _P, _P, _P, _S, _P, _S, _P, DecompressOpts, _P, _P],
}


def library_path() -> str:
    """Where libnvcomp.so.5 is taken from (the first that exists of env, wheel, soname)."""
    env = os.environ.get("ORBITKV_NVCOMP_LIBRARY")
    if env:
        return env
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / "lib64" / SONAME
        if candidate.is_file():
            return str(candidate)
    return SONAME


class Nvcomp:
    """The loaded library. Use :func:`load`; it caches one instance per process."""

    def __init__(self, path: str) -> None:
        try:
            self.lib = ctypes.CDLL(path, ctypes.RTLD_LOCAL)
        except OSError as e:
            raise CodecUnavailable(
                f"nvCOMP library {path!r} could not be loaded ({e}); install nvidia-libnvcomp-cu13==5.3.0.16 "
                "(pip install 'orbitkv-fs[gpu]') or set ORBITKV_NVCOMP_LIBRARY to libnvcomp.so.5"
            ) from e
        self.path = path
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(self.lib, name)
            except AttributeError:
                raise CodecUnavailable(f"nvCOMP library {path!r} lacks {name}: not the nvCOMP 5 C ABI") from None
            fn.argtypes = argtypes
            fn.restype = ctypes.c_char_p if name == "nvcompGetStatusString" else ctypes.c_int
        props = _Properties()
        self._check(self.lib.nvcompGetProperties(ctypes.byref(props)), "nvcompGetProperties")
        v = props.version
        self.version = (v // 1000, (v % 1000) // 100, v % 100)
        if not SUPPORTED[0] <= self.version[:2] < SUPPORTED[1]:
            raise CodecUnavailable(
                f"nvCOMP at {path!r} is version {'.'.join(map(str, self.version))}; this build speaks the ABI of "
                "nvCOMP 5.3+ (5.x): install nvidia-libnvcomp-cu13==5.3.0.16"
            )
        al = _Alignments()
        self._check(self.lib.nvcompBatchedANSCompressGetRequiredAlignments(self.compress_opts(AnsType.BYTES),
                                                                            ctypes.byref(al)), "alignments")
        self.compress_alignment = (al.input, al.output, al.temp)
        self._check(self.lib.nvcompBatchedANSDecompressGetRequiredAlignments(self.decompress_opts(AnsType.BYTES),
                                                                              ctypes.byref(al)), "alignments")
        self.decompress_alignment = (al.input, al.output, al.temp)
        if max(self.compress_alignment + self.decompress_alignment) > 256:
            raise CodecUnavailable(f"nvCOMP at {path!r} asks for alignments over 256 bytes: unsupported ABI")

    def status_name(self, status: int) -> str:
        return STATUS_NAMES.get(status, f"status {status}")

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NvcompError(f"nvCOMP {what} failed: {self.status_name(status)}")

    # The option structs (passed by value, never modified) and the size queries are the same for the same
    # arguments: they are built or asked once and memoised, so that a batch pays dictionary lookups, not
    # ctypes calls (the engine's workspace estimate asks for every segment it adds to a batch).
    @staticmethod
    @functools.cache
    def compress_opts(ans_type: AnsType) -> CompressOpts:
        return CompressOpts(0, NVCOMP_TYPES[AnsType(ans_type)], 0, b"")

    @staticmethod
    @functools.cache
    def decompress_opts(ans_type: AnsType) -> DecompressOpts:
        return DecompressOpts(0, NVCOMP_TYPES[AnsType(ans_type)], 0, b"")

    def compress_temp_bytes(self, num_chunks: int, max_chunk: int, total: int, ans_type: AnsType) -> int:
        return self._memo("ct", num_chunks, max_chunk, total, ans_type)

    def max_compressed_bytes(self, max_chunk: int, ans_type: AnsType) -> int:
        return self._memo("mx", 0, max_chunk, 0, ans_type)

    def decompress_temp_bytes(self, num_chunks: int, max_chunk: int, total: int, ans_type: AnsType) -> int:
        return self._memo("dt", num_chunks, max_chunk, total, ans_type)

    def _memo(self, what: str, num_chunks: int, max_chunk: int, total: int, ans_type: AnsType) -> int:
        key = (what, int(num_chunks), int(max_chunk), int(total), int(ans_type))
        memo = self.__dict__.setdefault("_sizes", {})
        got = memo.get(key)
        if got is None:
            if len(memo) > 65536:
                memo.clear()
            fn = {"ct": self._compress_temp_bytes, "dt": self._decompress_temp_bytes}.get(what)
            got = fn(*key[1:4], ans_type) if fn else self._max_compressed_bytes(max_chunk, ans_type)
            memo[key] = got
        return got

    def _compress_temp_bytes(self, num_chunks: int, max_chunk: int, total: int, ans_type: AnsType) -> int:
        out = _S()
        self._check(self.lib.nvcompBatchedANSCompressGetTempSizeAsync(num_chunks, max_chunk, self.compress_opts(ans_type),
                                                                       ctypes.byref(out), total), "compress temp size")
        return out.value

    def _max_compressed_bytes(self, max_chunk: int, ans_type: AnsType) -> int:
        out = _S()
        self._check(self.lib.nvcompBatchedANSCompressGetMaxOutputChunkSize(max_chunk, self.compress_opts(ans_type),
                                                                            ctypes.byref(out)), "max output size")
        return out.value

    def _decompress_temp_bytes(self, num_chunks: int, max_chunk: int, total: int, ans_type: AnsType) -> int:
        out = _S()
        self._check(self.lib.nvcompBatchedANSDecompressGetTempSizeAsync(num_chunks, max_chunk,
                                                                         self.decompress_opts(ans_type),
                                                                         ctypes.byref(out), total), "decompress temp size")
        return out.value

    def compress(self, in_ptrs: int, in_sizes: int, max_chunk: int, num: int, temp: int, temp_bytes: int,
                 out_ptrs: int, out_sizes: int, ans_type: AnsType, statuses: int, stream: int) -> None:
        """All pointers are device addresses of arrays of ``num`` entries (ptrs/sizes: 8 bytes, statuses: int)."""
        self._check(self.lib.nvcompBatchedANSCompressAsync(in_ptrs, in_sizes, max_chunk, num, temp, temp_bytes, out_ptrs,
                                                           out_sizes, self.compress_opts(ans_type), statuses, stream),
                    "compress")

    def decompress(self, in_ptrs: int, in_sizes: int, out_buffer_sizes: int, out_actual: int, num: int, temp: int,
                   temp_bytes: int, out_ptrs: int, ans_type: AnsType, statuses: int, stream: int) -> None:
        self._check(self.lib.nvcompBatchedANSDecompressAsync(in_ptrs, in_sizes, out_buffer_sizes, out_actual, num, temp,
                                                             temp_bytes, out_ptrs, self.decompress_opts(ans_type),
                                                             statuses, stream), "decompress")


@functools.cache
def load() -> Nvcomp:
    """The process's nvCOMP, loaded and checked once. Raises CodecUnavailable with the reason."""
    return Nvcomp(library_path())
