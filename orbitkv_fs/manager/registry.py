"""Engines: registration, the memory they hold, the requests they have in flight, and their processes.

Primitives: :meth:`Registry.register_engine` (validated against the imported tensors; a credential per
engine), :meth:`~Registry.list_engines`, :meth:`~Registry.get_engine`, :meth:`~Registry.unregister_engine`,
:meth:`~Registry._enter` / :meth:`~Registry._exit` (every engine call: authorisation and the in-flight
count), :meth:`~Registry.authenticate` (the same check, before a remote request's bulk is decoded),
:meth:`~Registry._check_chunks` (a request's keys and block ids), the housekeeping thread
(:func:`_housekeep`: :meth:`~Registry._reap_dead` of engines whose process exited, and the lease expiry of
:mod:`.leases`). :class:`_Seg` is one (layer, role) segment of an engine's chunks and how to gather,
scatter and code it; :class:`_ProcessWatch` one engine process.

State owned: ``_engines``, ``_claims`` (memory identities held), ``_inflight``, ``_lock`` / ``_cond``
(shared with :mod:`.leases`), the housekeeper. Invariants: a registration either registers in full or
leaves nothing mapped or claimed; an engine acts only as itself (``_enter`` authorises every call); one
piece of memory is held by at most one engine; unregister waits for the engine's requests, then drops its
leases and unmaps its memory; only an engine whose very process (pid and start time) exited is reaped.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
import uuid
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Sequence

import msgspec
import numpy as np

from ..access import Caller, authorize, file_identity, issue_credential, open_pages_file
from ..codecs import CODEC_NAMES, LOSSY_CODECS, Codec, get_codec
from ..errors import CodecError, OrbitKVError, SegmentError
from ..geometry import (
    AttentionKind,
    EngineRegistration,
    GeometryError,
    HostPagesHandle,
    TensorDesc,
    block_views,
    check_imported,
    layer_attention,
    num_blocks,
    parse_dtype,
    process_start_time,
    validate_registration,
)
from ..index import tail_subs
from ..keys import key_tails
from ..namespace import namespace_v2
from ..pages import HostPages, PagesError, import_cuda_tensor, reclaim_stale_pages
from ..segment import Format, RawReason, Role, SegmentHeader, dtype_code, header_row
from ..tiers.dram import arena_dir
from .api import (ChunkBlocks, EngineBusy, EngineInfo, PagesLost, RequestError, SKIP_BLOCK, TooManyEngines,
                  UnknownEngine)
from .batching import _coded_bound
from .device import _BLOCKS, _array_module, _geometry, _rows_of, _run_of, _to_host

if TYPE_CHECKING:
    from .facade import Manager

log = logging.getLogger("orbitkv_fs.manager")

#: Distinct pages files one registration may map (the connectors write one an engine). Python's mmap keeps a
#: descriptor of each mapped file, and descriptors are what the data plane's connections need too.
MAX_PAGES_FILES = 8


class _Seg:
    """One segment of every chunk of an engine: a (layer, role) of one tensor, and how to code it."""

    __slots__ = ("layer", "role", "desc", "codec", "raw_reason", "block_shape", "block_bytes", "dtype", "dtype_code",
                 "view", "base", "copy", "on_host", "codec_name", "_bounds", "_heads")

    def __init__(self, reg: EngineRegistration, desc: TensorDesc, array, role: Role, codec: Codec | None,
                 raw_reason: RawReason) -> None:
        self.layer = desc.layer
        self.role = role
        self.desc = desc
        self.codec = codec
        self.codec_name = codec.codec_id if codec is not None else "none"
        self.raw_reason = raw_reason
        self._bounds: dict[int, int] = {}  # blocks in a chunk -> coded_bound
        self._heads: dict[int, tuple[np.ndarray, int]] = {}  # payload bytes -> raw header template
        self.dtype = np.dtype(parse_dtype(desc.dtype))
        try:  # what a segment header of this tensor says (None: no header can match a dtype the format lacks)
            self.dtype_code: int | None = dtype_code(self.dtype)
        except SegmentError:
            self.dtype_code = None
        # block -> view of that block, specialised per layout (the hot loop of save and restore). ``base``,
        # where the layout allows, is a block-major view (base[b] is block b): a whole chunk then moves
        # with one gather or scatter (:meth:`gather`, :meth:`scatter`) instead of a copy per block.
        self.base = None
        if desc.layout == "vllm_packed":
            half = slice(0, reg.head_dim) if role == Role.KEY else slice(reg.head_dim, 2 * reg.head_dim)
            self.base = array[:, :, :, half]
            self.view = self.base.__getitem__
        elif desc.layout == "sglang_token_pool":
            t = reg.block_size
            self.view = lambda b: array[b * t:(b + 1) * t]
            n = array.shape[0] // t
            split = array[:n * t].reshape((n, t) + tuple(array.shape[1:]))
            if split.strides[:2] == (array.strides[0] * t, array.strides[0]):  # a view, not a copy
                self.base = split
        else:
            self.base = array
            self.view = array.__getitem__
        v = self.view(0)
        self.on_host = isinstance(v, np.ndarray)
        assert any(r == role and w.shape == v.shape for r, w in block_views(reg, desc, array, 0))
        self.block_shape = tuple(v.shape)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        # GPU pages whose blocks the engine's block-copy kernel can move (a whole batch in one launch):
        # (address of block 0, block stride, rows, row bytes, row stride) of a block as regular rows.
        self.copy: tuple[int, int, int, int, int] | None = None
        if self.base is not None and not isinstance(self.base, np.ndarray):
            rows = _rows_of(self.block_shape, self.base.strides[1:], self.dtype.itemsize)
            if rows is not None:
                self.copy = (int(self.base.data.ptr), int(self.base.strides[0])) + rows

    def coded_bound(self, nblocks: int) -> int:
        """:func:`_coded_bound` of a chunk of ``nblocks`` blocks (asked once per segment of every save)."""
        b = self._bounds.get(nblocks)
        if b is None:
            b = self._bounds[nblocks] = _coded_bound(self, nblocks * self.block_bytes)
        return b

    def raw_header(self, n: int) -> tuple[np.ndarray, int]:
        """The header template (:func:`~orbitkv_fs.segment.header_row`) of this segment stored raw with an
        ``n``-byte payload: what a save writes, and what a restore expects, of an exact segment."""
        t = self._heads.get(n)
        if t is None:
            t = self._heads[n] = header_row(SegmentHeader(Format.RAW, self.dtype, n, n, 0, role=self.role,
                                                          layer=self.layer, raw_reason=self.raw_reason))
        return t

    def gather_into(self, blocks: Sequence[int], out: np.ndarray) -> None:
        """Copy the blocks into the host array ``out`` (``[len(blocks), *block_shape]`` of the segment's
        dtype): one copy where the layout has a block-major host view, else a copy per block."""
        base = self.base
        if type(base) is np.ndarray:
            run = _run_of(blocks)
            if run is not None:
                np.copyto(out, base[run])
            elif base.dtype == out.dtype:
                np.take(base, blocks, axis=0, out=out)
            else:
                np.copyto(out, np.take(base, blocks, axis=0))
            return
        for j, b in enumerate(blocks):
            _to_host(self.view(b), out[j])

    def gather(self, blocks: Sequence[int]):
        """The blocks as one C-contiguous array ``[len(blocks), *block_shape]`` of the pages' kind (numpy
        or cupy): one gather where the layout has a block-major view."""
        if self.base is not None:
            xp = _array_module(self.base)
            run = _run_of(blocks)
            if run is not None:  # consecutive blocks: a plain copy, no index array to upload
                return xp.ascontiguousarray(self.base[run])
            return xp.take(self.base, xp.asarray(blocks, dtype=np.int64), axis=0)
        xp = _array_module(self.view(blocks[0]))
        return xp.stack([self.view(b) for b in blocks])

    def scatter(self, blocks: Sequence[int], src) -> None:
        """Write ``src`` (``[len(blocks), *block_shape]``, same array kind as the pages) into the blocks;
        positions whose block is :data:`SKIP_BLOCK` are not written."""
        if SKIP_BLOCK in blocks:
            keep = [j for j, b in enumerate(blocks) if b != SKIP_BLOCK]
            run = _run_of(keep)  # the usual case: leading and trailing skips, a plain slice of src
            blocks, src = [blocks[j] for j in keep], src[run] if run is not None else src[keep]
        if self.base is not None:
            run = _run_of(blocks)
            if run is not None:
                self.base[run] = src
                return
            xp = _array_module(self.base)
            self.base[xp.asarray(blocks, dtype=np.int64)] = src
            return
        for j, b in enumerate(blocks):
            self.view(b)[...] = src[j]


class _Engine:
    def __init__(self, info: EngineInfo, reg: EngineRegistration, ns: bytes, segs: list[_Seg],
                 num_blocks: int, imports: list, watch: "_ProcessWatch | None", secret: bytes,
                 owner_uid: int | None, counted: bool = False) -> None:
        self.info = info
        self.secret = secret  # the credential, as bytes
        self.owner_uid = owner_uid  # the registering OS user, when known
        self.counted = counted  # registered from another process: in its user's quota (Registry._check_quota)
        self.reg = reg
        self.ns = ns
        self.segs = segs
        self.tails = key_tails((s.layer, s.role) for s in segs)  # segs[i]'s key is ns + chunk + tails[i]
        self.subs = tail_subs(self.tails)  # ... and the index's sub of that key
        self.block_bytes = np.array([s.block_bytes for s in segs], dtype=np.int64)  # per segment (index)
        self.save_plans: dict = {}  # (blocks per chunk, exact segments on the host path) -> save.SavePlan
        self.seg_index = {id(s): i for i, s in enumerate(segs)}  # a save item's segment -> its index in segs
        self.enc_classes: dict = {}  # (segment index, blocks per chunk) -> the GPU engine's encode class
        self.enc_rows: dict = {}  # a save batch's pairs (bytes) -> (their classes or None: item path, class indices)
        # The segments' block geometry as one array (device._geometry) where the block-copy kernel moves
        # every one of them (GPU pages of regular rows), else None: those go one item per segment.
        self.geometry = _geometry(segs) if segs and all(s.copy is not None for s in segs) else None
        self.codecs = frozenset(s.codec_name for s in segs)  # its segments' codecs (batching._flights)
        self.num_blocks = num_blocks
        self.imports = imports  # closed on unregister (the watch too, when there is one)
        # Guards of the engine's pages files (host pages): faults past a file's end mean its owner shrank it.
        self.guards = [p.guard for p in imports if isinstance(p, HostPages) and p.guard is not None]
        self.lost = ""  # why the engine's calls are refused (its pages shrank), once they are
        self.watch = watch
        self.inflight = 0
        self.closing = False
        self.leases: dict[int, int] = {}  # lookup lease id -> chunks it pins, oldest first (.leases)
        self.leased_chunks = 0  # their sum
        self.displace_warned = -1e9  # when a displacement of its leases was last logged (monotonic)


class _ProcessWatch:
    """Whether one engine process still runs. A pidfd names the process itself, so a reused pid cannot
    fool it; without one (no ``os.pidfd_open``, a kernel before 5.3, a seccomp filter) ``kill(pid, 0)``
    and the start time in ``/proc/PID/stat`` (a zombie counts as dead) tell the same."""

    __slots__ = ("pid", "start", "fd")

    def __init__(self, pid: int, start: int, fd: int) -> None:
        self.pid = pid
        self.start = start
        self.fd = fd

    @classmethod
    def open(cls, pid: int, start: int | None) -> "_ProcessWatch | None":
        """A watch on ``pid``; None when this host shows no running process ``pid`` that started at
        ``start`` (another PID namespace, a reused pid, no ``/proc``): such an engine is not watched."""
        fd = -1
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                fd = pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:
                fd = -1
        # Read after the pidfd is open: if the pid changed hands in between, the start time differs.
        now = process_start_time(pid)
        if now is None or (start is not None and now != start):
            if fd >= 0:
                os.close(fd)
            return None
        return cls(pid, now, fd)

    def alive(self) -> bool:
        if self.fd >= 0:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            return not p.poll(0)  # a pidfd turns readable when its process exits
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        return process_start_time(self.pid) == self.start

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _layer_codec(reg: EngineRegistration, desc: TensorDesc, codec_name: str) -> tuple[Codec | None, RawReason]:
    """The codec of ``desc``'s segments (None: stored raw) and the raw reason when policy forces raw."""
    if codec_name == "none":
        return None, RawReason.NONE
    kind = layer_attention(reg, desc)
    lossy = codec_name in LOSSY_CODECS
    if lossy and kind == AttentionKind.RECURRENT:
        return None, RawReason.POLICY
    if codec_name.startswith("turboquant"):
        stage_edge = desc.layer < reg.layer_start + 2 or desc.layer >= reg.layer_end - 2
        if kind == AttentionKind.MLA or not reg.head_layout_verified or stage_edge:
            return None, RawReason.POLICY
        return get_codec(codec_name, seed=reg.rotation_seed), RawReason.NONE
    return get_codec(codec_name), RawReason.NONE


def _close_imports(imports: list) -> None:
    for obj in reversed(imports):
        obj.close()
    imports.clear()


#: How often the housekeeping thread looks for pages files of killed processes (a listing of --shm-dir and a
#: lock attempt on each pages file in it).
RECLAIM_INTERVAL_S = 5.0


def _housekeep(manager: "weakref.ref[Manager]", stop: threading.Event, interval: float) -> None:
    """The housekeeping thread: every ``interval`` seconds, reap the Manager's dead engines and drop its
    expired leases; every :data:`RECLAIM_INTERVAL_S`, remove stale pages files. Holds the Manager only during
    a round, so a Manager dropped without :meth:`Manager.close` can still go."""
    while not stop.wait(interval):
        m = manager()
        if m is None:
            return
        for job in (m._reap_dead, m._expire_leases, m._reclaim_round):
            try:
                job()
            except Exception:  # the thread must outlive one bad round
                log.exception("housekeeping: %s failed", job.__name__)
        del m


class Registry:
    """Engine registration, lookup by id, and the housekeeping of watched engines."""

    def _enter(self, engine_id: str, caller: Caller | None = None, *, lookup: bool = False) -> _Engine:
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing:
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            if caller is not None:
                authorize(engine_id, eng.secret, eng.owner_uid, eng.reg.lookup_by_user, caller, lookup=lookup)
            if eng.lost:
                raise PagesLost(eng.lost)
            eng.inflight += 1
            self._inflight += 1
            return eng

    def _check_pages(self, eng: _Engine) -> None:
        """Raise :class:`PagesLost` when the engine's pages file shrank under the Manager's mapping since it was
        registered (a fault past its end, survived by :mod:`orbitkv_fs.mapguard`): what was read there is
        zeros, not the engine's KV, and must not be published. The engine's later calls are refused too."""
        if not eng.guards or not any(g.faults for g in eng.guards):
            return
        with self._lock:  # two calls of the engine may find it at once: it is counted and logged once
            first = not eng.lost
            if first:
                eng.lost = (f"engine {eng.info.engine_id!r}: its pages file shrank while the Manager had it mapped "
                            f"({sum(g.faults for g in eng.guards)} pages past its end were touched): nothing read "
                            f"from it was kept; unregister the engine and register it again over whole pages")
        if first:
            log.warning("%s", eng.lost)
            self._add(pages_lost=1)
        raise PagesLost(eng.lost)

    def authenticate(self, engine_id: str, caller: Caller, *, lookup: bool = False) -> None:
        """Check that ``caller`` may act for ``engine_id`` (``lookup``: a lease-free lookup) without starting a
        call: the data plane asks before it decodes a request's chunks or keys, so that a process without the
        credential makes the Manager build nothing. The call itself checks again (:meth:`_enter`). Raises
        :class:`UnknownEngine` or :class:`~orbitkv_fs.access.Unauthenticated`."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            authorize(engine_id, eng.secret, eng.owner_uid, eng.reg.lookup_by_user, caller, lookup=lookup)

    def _exit(self, eng: _Engine) -> None:
        with self._lock:
            eng.inflight -= 1
            self._inflight -= 1
            if eng.closing:  # only unregister waits (for a closing engine's requests to drain)
                self._cond.notify_all()

    def register_engine(self, reg: EngineRegistration, *, caller: Caller | None = None) -> EngineInfo:
        """Validate ``reg`` against the tensors its handles import, then register it. Raises
        :class:`GeometryError` (naming the field), :class:`~orbitkv_fs.access.HandleInUse` or
        :class:`EngineBusy` and registers nothing on any of them. A host-pages handle must name a regular
        file; with a ``caller``, directly inside ``shm_dir`` and owned by the caller's OS user. The answer carries
        the engine's credential (:attr:`EngineInfo.credential`), which every later call for the engine
        must present."""
        validate_registration(reg)
        codec_name = reg.codec or self._config.storage_codec
        if codec_name not in CODEC_NAMES:
            raise GeometryError("codec", f"unknown codec {codec_name!r}; expected {', '.join(CODEC_NAMES)}")
        if codec_name == "ans":
            try:
                get_codec("ans")
            except CodecError as e:
                raise GeometryError("codec", str(e)) from None
        imports: list = []
        try:
            watch = None
            if reg.pid is not None and self._config.engine_check_interval > 0:
                watch = _ProcessWatch.open(reg.pid, reg.pid_start_time)
                if watch is None:
                    log.warning("engine process %d is not visible to the Manager as registered (another PID "
                                "namespace, or it exited): it will not be unregistered when it dies", reg.pid)
                else:
                    imports.append(watch)
            owner_uid = caller.uid() if caller is not None else os.getuid()
            if caller is not None and owner_uid is None and any(isinstance(d.handle, HostPagesHandle)
                                                                for d in reg.tensors):
                why = caller.unknown_because or "a remote TCP peer?"
                raise GeometryError("tensors", f"cannot tell which OS user sent this registration ({why}): host "
                                               "pages are registered over ipc:// or loopback")
            if caller is not None:  # before anything is mapped, and again as it is registered
                with self._lock:
                    self._check_quota(owner_uid, len(reg.tensors))
            arrays, device, handles = self._import_tensors(reg, imports, caller is not None, owner_uid)
            segs: list[_Seg] = []
            exact_layers: set[int] = set()
            for desc, arr in zip(reg.tensors, arrays):
                codec, reason = _layer_codec(reg, desc, codec_name)
                if codec is None and codec_name != "none":
                    exact_layers.add(desc.layer)
                for role, _ in block_views(reg, desc, arr, 0):
                    segs.append(_Seg(reg, desc, arr, role, codec, reason))
            segs.sort(key=lambda s: (s.layer, int(s.role)))
            blocks = min(num_blocks(reg, d) for d in reg.tensors)
            ns = namespace_v2(reg, codec_name)
            with self._lock:
                if self._closed:
                    raise OrbitKVError("the Manager is closed")
                engine_id = reg.engine_id or f"{reg.engine_kind}-{uuid.uuid4().hex[:12]}"
                if engine_id in self._engines:
                    raise EngineBusy(f"engine id {engine_id!r} is already registered")
                if caller is not None:
                    self._check_quota(owner_uid, len(reg.tensors))
                self._claims.claim(engine_id, handles)
                info = EngineInfo(engine_id=engine_id, namespace=ns.hex(), codec=codec_name, model=reg.model,
                                  layer_start=reg.layer_start, layer_end=reg.layer_end, num_blocks=blocks,
                                  segments_per_chunk=len(segs), exact_layers=sorted(exact_layers), device=device,
                                  registration=reg, watched=watch is not None)
                credential = issue_credential()
                self._engines[engine_id] = _Engine(info, reg, ns, segs, blocks, imports, watch, credential.encode(),
                                                   owner_uid, caller is not None)
                if watch is not None:
                    self._start_housekeeping()
            return msgspec.structs.replace(info, credential=credential)
        except BaseException:
            _close_imports(imports)
            raise

    def _check_quota(self, uid: int | None, tensors: int) -> None:
        """Raise :class:`TooManyEngines` when one more engine of ``tensors`` tensors would put OS user ``uid``
        over its quota (``max_engines_per_user``, ``max_tensors_per_user``), counting the engines it registered
        from another process. Called with ``_lock`` held."""
        mine = [e for e in self._engines.values() if e.counted and e.owner_uid == uid]
        held = sum(len(e.reg.tensors) for e in mine)
        c = self._config
        if len(mine) + 1 > c.max_engines_per_user or held + tensors > c.max_tensors_per_user:
            self._add(registrations_refused=1)
            raise TooManyEngines(f"OS user {uid} has {len(mine)} engines of {held} tensors registered; one more, of "
                                 f"{tensors} tensors, would be over the quota of {c.max_engines_per_user} engines "
                                 f"and {c.max_tensors_per_user} tensors a user (--max-engines-per-user, "
                                 "--max-tensors-per-user): unregister one first")

    def _import_tensors(self, reg: EngineRegistration, imports: list, untrusted: bool,
                        owner_uid: int | None) -> tuple[list, str, list[tuple[str, tuple, int, int]]]:
        """Map every tensor's handle; check it against its descriptor. Host pages files are opened once,
        through :func:`~orbitkv_fs.access.open_pages_file`: a regular file and, for an ``untrusted``
        registrant, inside ``shm_dir`` and of ``owner_uid``. Answers the arrays, the device and each
        handle's memory identity."""
        files: dict[str, HostPages] = {}
        arrays = []
        handles: list[tuple[str, tuple, int, int]] = []
        kinds = {type(d.handle) for d in reg.tensors}
        if len(kinds) > 1:
            raise GeometryError("tensors", "host pages and CUDA IPC handles cannot be mixed in one engine")
        device = "host"
        for i, desc in enumerate(reg.tensors):
            at = f"tensors[{i}]"
            h = desc.handle
            if isinstance(h, HostPagesHandle):
                pages = files.get(h.path)
                if pages is None:
                    if len(files) == MAX_PAGES_FILES:
                        raise GeometryError(f"{at}.handle.path", f"an engine's tensors lie in at most "
                                            f"{MAX_PAGES_FILES} pages files (each holds a descriptor and a memory "
                                            "map of the Manager)")
                    fd = open_pages_file(h.path, arena_dir(self._config.shm_dir) if untrusted else None,
                                         owner_uid if untrusted else None, f"{at}.handle.path")
                    ident = file_identity(fd)
                    if ident == self._arena_identity:
                        os.close(fd)
                        raise GeometryError(f"{at}.handle.path", "names the Manager's own arena file")
                    try:
                        pages = HostPages.open(h.path, fd=fd, guarded=True)
                    except PagesError as e:
                        raise GeometryError(f"{at}.handle.path", str(e)) from None
                    pages.identity = ident
                    files[h.path] = pages
                    imports.append(pages)
                handles.append((f"{at}.handle", pages.identity, 0, 1 << 64))
                try:
                    t, arr = pages.at(h.offset)
                except PagesError as e:
                    raise GeometryError(f"{at}.handle.offset", str(e)) from None
                check_imported(desc, at, dtype=parse_dtype(t.dtype), shape=tuple(t.shape),
                               strides=tuple(t.strides), role=t.role)
                if t.layer >= 0 and t.layer != desc.layer:
                    raise GeometryError(f"{at}.layer", f"declared {desc.layer}, the pages file says {t.layer}")
                if t.layout and t.layout != desc.layout:
                    raise GeometryError(f"{at}.layout", f"declared {desc.layout}, the pages file says {t.layout}")
            else:
                if not self._gpu:
                    raise GeometryError(f"{at}.handle", "CUDA IPC handle given, but this Manager has no GPU")
                arr, owner = import_cuda_tensor(desc, at)
                imports.append(owner)
                device = f"cuda:{h.device}"
                handles.append((f"{at}.handle", ("cuda_ipc", h.handle, h.device), h.offset, h.offset + arr.data.mem.size))
            arrays.append(arr)
        return arrays, device, handles

    def list_engines(self) -> list[EngineInfo]:
        with self._lock:
            return [e.info for e in self._engines.values() if not e.closing]

    def get_engine(self, engine_id: str) -> EngineInfo:
        """Raises :class:`UnknownEngine`."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing:
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            return eng.info

    def unregister_engine(self, engine_id: str, *, timeout: float | None = 60.0, caller: Caller | None = None) -> None:
        """Refuse new requests for the engine, wait for its outstanding ones, release its leases, codec
        resources and imported tensors. Cached objects stay (they belong to the namespace)."""
        self._unregister(engine_id, timeout, caller=caller)

    def _unregister(self, engine_id: str, timeout: float | None, only: _Engine | None = None,
                    caller: Caller | None = None) -> None:
        """:meth:`unregister_engine`; with ``only``, only that registration (not a later one that took
        the same id while the reaper looked)."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.closing or (only is not None and eng is not only):
                raise UnknownEngine(f"no engine {engine_id!r} is registered")
            if caller is not None:
                authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
            eng.closing = True
            if not self._cond.wait_for(lambda: eng.inflight == 0, timeout):
                eng.closing = False
                raise EngineBusy(f"engine {engine_id!r} still has {eng.inflight} requests after {timeout}s")
            leases = [self._leases.pop(i) for i in list(eng.leases) if i in self._leases]
            del self._engines[engine_id]
            self._claims.release(engine_id)
        for lease in leases:
            self._drop_lease(lease)
        # The segment views are the last references into the imported memory: dropped first, the
        # imports' close unmaps the pages file (or closes the CUDA IPC mapping) at once.
        eng.segs = []
        _close_imports(eng.imports)

    def _start_housekeeping(self) -> None:
        """Start the housekeeping thread if it is not running. Called with ``_lock`` held."""
        if self._housekeeper is not None or self._closed:
            return
        c = self._config
        periods = [c.engine_check_interval] if c.engine_check_interval > 0 else []
        if c.lease_ttl > 0:
            periods.append(min(c.lease_ttl / 4, 5.0))
        self._housekeeper = threading.Thread(target=_housekeep, args=(weakref.ref(self), self._housekeeper_stop,
                                                                  min(periods, default=1.0)),
                                         name="orbitkv-housekeeping", daemon=True)
        self._housekeeper.start()

    def _reap_dead(self) -> None:
        """Unregister every watched engine whose process has exited (the housekeeping thread's round)."""
        with self._lock:
            watched = [(i, e) for i, e in self._engines.items() if e.watch is not None and not e.closing]
        for engine_id, eng in watched:
            if eng.watch.alive():
                continue
            try:
                self._unregister(engine_id, 60.0, only=eng)
            except UnknownEngine:
                continue  # unregistered meanwhile
            except EngineBusy as e:  # requests still running for it: the next round tries again
                log.warning("engine %r (pid %d) exited but %s", engine_id, eng.watch.pid, e)
                continue
            # Killed with SIGKILL, it left its pages file (vLLM force-kills a worker that does not stop in
            # time). Removed before the reap is counted: the count says the reaping is complete.
            self._reclaim_pages()
            self._add(engines_reaped=1)
            log.warning("engine %r: its process %d exited; unregistered it", engine_id, eng.reg.pid)

    def _reclaim_round(self) -> None:
        """:meth:`_reclaim_pages` at most every :data:`RECLAIM_INTERVAL_S` (a housekeeping job). A reap does not
        see every killed engine: vLLM's shutdown lets the worker unregister, then may kill it before it
        removed its staging file."""
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + RECLAIM_INTERVAL_S
            self._reclaim_pages()

    def _reclaim_pages(self) -> None:
        """Remove the pages files of processes that were killed before they could remove them: a tmpfs file
        holds its memory until then. Only files whose creator is gone (:func:`reclaim_stale_pages`)."""
        directory = arena_dir(self._config.shm_dir)
        files, nbytes = reclaim_stale_pages(directory)
        if files:
            self._add(pages_files_reclaimed=files)
            log.warning("removed %d engine pages files (%.1f MB) of processes that were killed, from %s", files,
                        nbytes / 1e6, directory)

    def _check_chunks(self, eng: _Engine, chunks: Sequence[ChunkBlocks], *, skips: bool = False) -> None:
        """Keys and block ids of a request; ``skips``: :data:`SKIP_BLOCK` positions are allowed (a restore),
        as long as each chunk writes at least one block. The blocks are checked as one array; a request that
        fails is walked again chunk by chunk, block by block, for the first fault's message. A save naming more
        blocks than the engine has (each may come once) is refused before either."""
        if not skips:
            total = sum(map(len, map(_BLOCKS, chunks)))
            if total > eng.num_blocks:
                raise RequestError(f"chunks: {total} block ids in one request, the engine has {eng.num_blocks} "
                                   "blocks (each at most once)")
        if not _chunks_ok(chunks, eng.num_blocks, skips):
            self._check_chunks_walk(eng, chunks, skips=skips)

    def _check_chunks_walk(self, eng: _Engine, chunks: Sequence[ChunkBlocks], *, skips: bool = False) -> None:
        """:meth:`_check_chunks` one block at a time: raises :class:`RequestError` naming the first fault."""
        seen: set[int] = set()
        for i, ch in enumerate(chunks):
            if not isinstance(ch.key, bytes) or len(ch.key) != 16:
                raise RequestError(f"chunks[{i}].key: a chunk key is 16 bytes")
            if not ch.blocks:
                raise RequestError(f"chunks[{i}].blocks: no blocks")
            skipped = 0
            for b in ch.blocks:
                if b == SKIP_BLOCK and skips:
                    skipped += 1
                    continue
                if not 0 <= b < eng.num_blocks:
                    raise RequestError(f"chunks[{i}].blocks: unknown block {b} (engine has {eng.num_blocks})")
                if b in seen:
                    raise RequestError(f"chunks[{i}].blocks: block {b} appears twice in one request")
                seen.add(b)
            if skipped == len(ch.blocks):
                raise RequestError(f"chunks[{i}].blocks: every position is SKIP_BLOCK, nothing to restore")


def _chunks_ok(chunks: Sequence[ChunkBlocks], num_blocks: int, skips: bool) -> bool:
    """Whether every chunk of a request has a 16-byte key and blocks, its blocks are ids below ``num_blocks``
    (or, with ``skips``, :data:`SKIP_BLOCK`, not all of a chunk's), none twice in the request: one numpy pass
    over the blocks. False for anything else, a block id that is not an int among them (the walk then says
    what is wrong)."""
    if not all(type(ch.key) is bytes and len(ch.key) == 16 and ch.blocks for ch in chunks):
        return False
    blocks = list(chain.from_iterable(map(_BLOCKS, chunks)))
    if not set(map(type, blocks)) <= {int}:  # numpy would take "3" or 3.5 as 3
        return False
    try:
        flat = np.array(blocks, dtype=np.int64)
    except OverflowError:
        return False
    if not len(flat):
        return True
    counts = np.fromiter(map(len, map(_BLOCKS, chunks)), dtype=np.int64, count=len(chunks))
    real = flat != SKIP_BLOCK if skips else np.ones(len(flat), dtype=bool)
    ids = flat[real]
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        return False
    if skips and not np.add.reduceat(real, np.cumsum(counts) - counts).all():  # a chunk of skips only
        return False
    return len(np.unique(ids)) == len(ids)
