"""Host "engine pages": KV tensors in a self-describing shared-memory file.

Without a GPU an engine's KV pages live here, and the Manager imports them by path and offset exactly as
it imports GPU tensors through CUDA IPC. The file is the contract between the engine process and the
Manager process; it describes its own tensors so that a registration can be checked against what is
really there.

File layout: a header (4096 bytes, or as many 4096-byte pages as the table needs) -- magic ``OKVP``,
version u32, table length u32, then a msgpack table of :class:`PageTensor` (name, offset, shape, strides in elements, dtype, role tag) -- followed by
the tensors' bytes, each 4096-aligned, C-contiguous.

Primitives: :meth:`HostPages.create`, :meth:`HostPages.open`, :meth:`HostPages.array`,
:meth:`HostPages.handle`, :meth:`HostPages.descriptor`, :meth:`HostPages.close`; :func:`host_engine_pages`
builds a whole engine's KV in one file (tests, benchmarks, CPU engines); :func:`reclaim_stale_pages` removes
the files of creators that were killed; :func:`import_cuda_tensor` is the GPU counterpart of
:meth:`HostPages.at`.

Invariants: tensors never overlap and lie inside the file; the table is validated on open (a file that
lies about its tensors is refused with :class:`PagesError`), and bounded before it is decoded (at most
:data:`MAX_TABLE_BYTES`, :data:`~orbitkv_fs.geometry.MAX_TENSORS` tensors): anyone may register their own file;
``create`` unlinks nothing it did not create. A file ``create`` names itself (``orbitkv-pages-<pid>-<hex>``) is
its creator's for as long as the creator lives (:func:`~orbitkv_fs.shmfiles.create_owned`: its flock), so a
creator killed with SIGKILL leaves nothing that :func:`reclaim_stale_pages` cannot remove; its memory is
allocated when it is made, so a directory too small for it refuses it
(:class:`~orbitkv_fs.shmfiles.ShmSpaceError`) instead of a later write dying of SIGBUS. A file opened
``guarded`` (the Manager's mapping of an engine's file, which its owner may shrink at any time) is guarded from
before its header is read until it is unmapped (:mod:`~orbitkv_fs.mapguard`).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Annotated, Sequence

import msgspec
import numpy as np

from .errors import OrbitKVError
from .geometry import MAX_TENSORS, Dims, HostPagesHandle, TensorDesc, parse_dtype
from .mapguard import Guard, guard as guard_mapping, unmap
from .shmfiles import create_owned, reclaim_stale, size_file

#: One page block of a GPU gather or scatter (the codec engine's block-copy kernel, ``struct BlockCopy``
#: of ``gpu/kernels/blocks.cu``, byte for byte): ``rows`` rows of ``row_bytes`` bytes, ``src_stride`` /
#: ``dst_stride`` apart. Defined here, with the pages, so that the Manager builds tables without cupy.
BLOCK_COPY_DTYPE = np.dtype({"names": ["src", "dst", "src_stride", "dst_stride", "rows", "row_bytes"],
                             "formats": ["<u8", "<u8", "<u8", "<u8", "<u4", "<u4"],
                             "offsets": [0, 8, 16, 24, 32, 36], "itemsize": 40})

#: Files :meth:`HostPages.create` names itself: ``orbitkv-pages-<pid>-<12 hex>``, locked by their creator.
PAGES_PREFIX = "orbitkv-pages-"
_SMALLER = "make the engine's pages or staging area smaller (the connectors' orbitkv.staging_mib)"
MAGIC = b"OKVP"
VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096
_HDR = struct.Struct("<4sII")
#: The longest tensor table a pages file may carry (about 160 bytes a tensor at MAX_TENSORS). The file is
#: the registrant's: its table is read with what it may make the Manager build bounded, like a registration.
MAX_TABLE_BYTES = 4 << 20


class PagesError(OrbitKVError, ValueError):
    """An engine pages file is missing, malformed, or has no tensor at the asked offset."""


class PageTensor(msgspec.Struct, frozen=True):
    name: str
    offset: int
    shape: Dims
    strides: Dims
    dtype: str
    role: str
    layer: int = -1
    layout: str = ""


_TABLE = msgspec.msgpack.Decoder(Annotated[list[PageTensor], msgspec.Meta(max_length=MAX_TENSORS)])


class HostPages:
    """An engine pages file mapped read-write."""

    def __init__(self, path: str, mm: mmap.mmap, table: list[PageTensor], owner: bool, lock: int = -1,
                 guard: Guard | None = None) -> None:
        self.path = path
        self._lock = lock  # the descriptor holding the file's flock (create_owned), -1 for none
        self._mm = mm
        self._buf = np.frombuffer(mm, dtype=np.uint8)
        #: Where the file is another process's (the Manager's mapping of an engine's file): faults past its end,
        #: should the owner shrink it, are survived and counted here (:mod:`orbitkv_fs.mapguard`).
        self.guard = guard
        self.tensors = {t.name: t for t in table}
        self._by_offset = {t.offset: t for t in table}
        self._owner = owner
        self.identity: tuple = ()  # the memory's identity once a Manager checked it (orbitkv_fs.access)

    @classmethod
    def create(cls, specs: Sequence[tuple[str, Sequence[int], str, str]] | Sequence[PageTensor],
               *, path: str | None = None, directory: str = "/dev/shm") -> "HostPages":
        """Create a zero-filled file holding ``specs``: ``(name, shape, dtype, role)`` tuples or
        :class:`PageTensor` (whose offset/strides are recomputed). ``role`` is kv|key|value|opaque."""
        norm = []
        for spec in specs:
            if isinstance(spec, PageTensor):
                norm.append((spec.name, spec.shape, spec.dtype, spec.role, spec.layer, spec.layout))
            else:
                norm.append((*spec, -1, ""))
        header = HEADER_BYTES
        while True:  # the table's size depends on the offsets, which depend on the header's size
            table: list[PageTensor] = []
            off = header
            for name, shape, dtype, role, layer, layout in norm:
                dt = parse_dtype(dtype)
                shape = [int(x) for x in shape]
                table.append(PageTensor(name, off, shape, _c_strides(shape), dtype, role, layer, layout))
                off += -(-int(np.prod(shape)) * dt.itemsize // ALIGN) * ALIGN
            blob = msgspec.msgpack.encode(table)
            if _HDR.size + len(blob) <= header:
                break
            header = -(-(_HDR.size + len(blob)) // ALIGN) * ALIGN
        if path is None:  # this process's own file: locked while it lives, reclaimed once it is gone
            path, fd = create_owned(directory if os.path.isdir(directory) else "/tmp", PAGES_PREFIX, off,
                                    reserve=True, what="the pages file", hint=_SMALLER)
            lock = fd
        else:  # a file named by the caller outlives its creator (the sample engine's): no lock, never reclaimed
            fd, lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), -1
        try:
            if lock < 0:
                size_file(fd, off, os.path.dirname(os.path.abspath(path)), reserve=True, what="the pages file",
                          hint=_SMALLER)
            mm = mmap.mmap(fd, off)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        if lock < 0:
            os.close(fd)
        mm[: _HDR.size + len(blob)] = _HDR.pack(MAGIC, VERSION, len(blob)) + blob
        return cls(path, mm, table, owner=True, lock=lock)

    @classmethod
    def open(cls, path: str, *, fd: int | None = None, guarded: bool = False) -> "HostPages":
        """Map an existing file read-write, validating its table. ``fd`` (closed here) is the file already
        opened and checked by the caller (:func:`orbitkv_fs.access.open_pages_file`): what is mapped is
        then exactly what was checked, whatever ``path`` names by now. ``guarded``: the file is another
        process's, which may shrink it while it is mapped; the mapping is guarded from the start
        (:attr:`guard`), before its header is read."""
        if fd is None:
            try:
                # O_NOFOLLOW: a symlink swapped in after the caller's checks must not redirect the mapping.
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as e:
                raise PagesError(f"cannot open engine pages file {path!r}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise PagesError(f"{path!r} is shorter than the pages header")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        guard = None
        try:
            if guarded:
                view = np.frombuffer(mm, dtype=np.uint8)
                try:
                    guard = guard_mapping(view.ctypes.data, size)
                except OverflowError as e:
                    raise PagesError(f"{path!r} cannot be mapped: {e}") from None
                finally:
                    del view
            magic, version, n = _HDR.unpack(mm[: _HDR.size])
            if magic != MAGIC or version != VERSION or _HDR.size + n > size:
                raise PagesError(f"{path!r} is not an engine pages file (v{VERSION})")
            if n > MAX_TABLE_BYTES:
                raise PagesError(f"{path!r}: a tensor table of {n} bytes (at most {MAX_TABLE_BYTES})")
            try:
                table = _TABLE.decode(mm[_HDR.size:_HDR.size + n])
            except msgspec.DecodeError as e:
                raise PagesError(f"{path!r}: bad tensor table: {e}") from None
            end = _HDR.size + n
            for t in sorted(table, key=lambda t: t.offset):
                dt = parse_dtype(t.dtype)
                if t.offset < end or t.offset % ALIGN or any(s <= 0 for s in t.shape) or \
                        t.strides != _c_strides(t.shape):
                    raise PagesError(f"{path!r}: tensor {t.name!r} overlaps or is malformed")
                end = t.offset + int(np.prod(t.shape)) * dt.itemsize
                if end > size:
                    raise PagesError(f"{path!r}: tensor {t.name!r} extends past the end of the file")
        except BaseException:
            mm.close()
            if guard is not None:
                guard.release()
            raise
        return cls(path, mm, table, owner=False, guard=guard)

    def array(self, name: str) -> np.ndarray:
        """Writable view of tensor ``name``."""
        return self._view(self.tensors[name])

    def _view(self, t: PageTensor) -> np.ndarray:
        dt = parse_dtype(t.dtype)
        n = int(np.prod(t.shape)) * dt.itemsize
        return self._buf[t.offset:t.offset + n].view(dt).reshape(t.shape)

    def at(self, offset: int) -> tuple[PageTensor, np.ndarray]:
        """The tensor starting at ``offset`` and its view. Raises :class:`PagesError`."""
        t = self._by_offset.get(offset)
        if t is None:
            raise PagesError(f"{self.path!r} holds no tensor at offset {offset}")
        return t, self._view(t)

    def handle(self, name: str) -> HostPagesHandle:
        return HostPagesHandle(self.path, self.tensors[name].offset)

    def descriptor(self, name: str, *, layer: int | None = None, layout: str | None = None) -> TensorDesc:
        """A :class:`TensorDesc` registering tensor ``name`` as it is in this file."""
        t = self.tensors[name]
        return TensorDesc(layer=t.layer if layer is None else layer, role=t.role,
                          layout=t.layout if layout is None else layout, shape=list(t.shape),
                          strides=list(t.strides), dtype=t.dtype, handle=self.handle(name), name=name)

    def close(self, *, unlink: bool | None = None) -> None:
        """Unmap; unlink the file when this object created it (or when ``unlink``). A file ``create`` named
        itself and kept here with ``unlink=False`` is no longer locked: :func:`reclaim_stale_pages` may take it."""
        self._buf = None  # type: ignore[assignment]
        unmap(self._mm, self.guard)  # views still alive elsewhere: the mapping (and its guard) goes when they do
        if unlink if unlink is not None else self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._lock >= 0:  # after the unlink: a reclaimer never finds the file unlocked while it has its name
            os.close(self._lock)
            self._lock = -1

    def __enter__(self) -> "HostPages":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _c_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= int(s)
    return strides[::-1]


def host_engine_pages(*, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                      dtype: str = "bfloat16", layout: str = "separate", layer_start: int = 0,
                      directory: str = "/dev/shm") -> tuple[HostPages, list[TensorDesc]]:
    """A pages file holding layers ``layer_start .. layer_start + num_layers - 1`` of one engine in
    ``layout`` (see :mod:`orbitkv_fs.geometry`), and the descriptors that register them."""
    b, t, h, d = num_blocks, block_size, num_heads, head_dim
    shapes = {"vllm_packed": [("kv", (b, h, t, 2 * d))],
              "separate": [("key", (b, t, h, d)), ("value", (b, t, h, d))],
              "sglang_token_pool": [("key", (b * t, h, d)), ("value", (b * t, h, d))],
              "mla": [("opaque", (b, t, d))],
              "state": [("opaque", (b, h, d))]}
    if layout not in shapes:
        raise PagesError(f"unknown layout {layout!r}")
    specs = [PageTensor(f"L{layer}.{role}", 0, list(shape), [], dtype, role, layer, layout)
             for layer in range(layer_start, layer_start + num_layers) for role, shape in shapes[layout]]
    pages = HostPages.create(specs, directory=directory)
    return pages, [pages.descriptor(t.name) for t in specs]


def reclaim_stale_pages(directory: str = "/dev/shm") -> tuple[int, int]:
    """Remove the pages files :meth:`HostPages.create` named in ``directory`` whose creator is gone (killed
    before it could remove them: a tmpfs file holds its memory until then); answers (files, bytes). A live
    creator's file, a file named by its caller and every other file stay
    (:func:`~orbitkv_fs.shmfiles.reclaim_stale`)."""
    return reclaim_stale(directory, PAGES_PREFIX, hex_digits=12)


_CUPY_NATIVE = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool"}


def cupy_dtype(dt: np.dtype) -> np.dtype:
    """The dtype cupy holds ``dt`` as: itself, or the unsigned int of its size (bfloat16, float8 types)."""
    dt = np.dtype(dt)
    return dt if dt.name in _CUPY_NATIVE else np.dtype(f"u{dt.itemsize}")


class CudaImport:
    """A tensor imported from another process through CUDA IPC; ``close`` unmaps the handle."""

    def __init__(self, ptr: int, device: int) -> None:
        self._ptr = ptr
        self._device = device

    def close(self) -> None:
        if self._ptr:
            import cupy

            with cupy.cuda.Device(self._device):
                cupy.cuda.runtime.ipcCloseMemHandle(self._ptr)
            self._ptr = 0


def import_cuda_tensor(desc: TensorDesc, field: str):
    """``(cupy array, CudaImport)`` of a :class:`CudaIpcHandle` descriptor, its extent checked against the
    shared allocation's size. The array's dtype is :func:`cupy_dtype` of the declared one (cupy has no
    bfloat16). Needs cupy and a GPU."""
    import cupy

    from .geometry import CudaIpcHandle, GeometryError

    h = desc.handle
    assert isinstance(h, CudaIpcHandle)
    dt = parse_dtype(desc.dtype, f"{field}.dtype")
    extent = (sum((n - 1) * s for n, s in zip(desc.shape, desc.strides)) + 1) * dt.itemsize
    if h.size and h.offset + extent > h.size:
        raise GeometryError(f"{field}.shape", f"tensor extent {extent} at offset {h.offset} exceeds the "
                            f"{h.size}-byte allocation")
    if len(h.handle) != 64:
        raise GeometryError(f"{field}.handle.handle", "a cudaIpcMemHandle_t is 64 bytes")
    with cupy.cuda.Device(h.device):
        try:
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(h.handle)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise GeometryError(f"{field}.handle", f"cannot open the CUDA IPC handle: {e}") from None
        owner = CudaImport(ptr, h.device)
        mem = cupy.cuda.UnownedMemory(ptr + h.offset, extent, owner, device_id=h.device)
        arr = cupy.ndarray(tuple(desc.shape), dtype=cupy_dtype(dt), memptr=cupy.cuda.MemoryPointer(mem, 0),
                           strides=tuple(s * dt.itemsize for s in desc.strides))
    return arr, owner
