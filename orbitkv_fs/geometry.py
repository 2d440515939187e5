"""Engine geometry: what an engine registers about its KV tensors, and how a block maps to bytes.

Owns the registration wire types and the validation of a registration against the tensors the Manager
actually imported. Primitives:

* :class:`EngineRegistration` / :class:`TensorDesc` / :class:`HostPagesHandle` / :class:`CudaIpcHandle`
  -- msgspec structs, the same on the data plane, over REST (``msgspec.to_builtins``) and in-process.
* :func:`validate_registration` -- the checks that need no tensor (fields, layer coverage, roles, expected
  shapes from the declared geometry); raises :class:`GeometryError` naming the field.
* :func:`check_imported` -- the declared descriptor against an imported tensor's dtype, shape, strides
  and role tag; raises :class:`GeometryError` naming the field.
* :func:`block_views` -- the array views of one block of one tensor for each K/V role it holds: what a
  segment gathers on save and scatters on restore.
* :func:`process_start_time` -- a running process's start time (``/proc/PID/stat``), which together with
  its pid names one process for the life of the host: what a registration's ``pid`` /
  ``pid_start_time`` carry so that the Manager can unregister an engine whose process died.

Layouts (``B`` blocks, ``T`` = block_size tokens, ``H`` KV heads, ``D`` = head_dim):

====================  ==========  =====================  ============================================
layout                role        shape                  one block (per role)
====================  ==========  =====================  ============================================
``vllm_packed``       ``kv``      ``[B, H, T, 2D]``      ``x[b, :, :, :D]`` (key), ``x[b, :, :, D:]``
``separate``          key|value   ``[B, T, H, D]``       ``x[b]``
``sglang_token_pool`` key|value   ``[N, H, D]``, N >= T  ``x[b*T:(b+1)*T]`` (layer-first token pool)
``mla``               opaque      ``[B, T, D]``          ``x[b]`` (D = latent width), always exact
``state``             opaque      ``[S, ...]``           ``x[s]`` (recurrent / conv state slot), exact
====================  ==========  =====================  ============================================

Invariants: a head layout is never inferred from a byte count -- every shape is checked against the
declared ``num_heads``/``head_dim``/``block_size``; strides are element strides and are checked as given
(non-contiguous views such as vLLM's ``kv_cache[0]`` are fine); a registration either validates entirely or
raises before anything is imported or registered.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
import numpy as np

from .errors import OrbitKVError
from .segment import Role, dtype_code

__all__ = [
    "AttentionKind",
    "CudaIpcHandle",
    "Dims",
    "EngineRegistration",
    "GeometryError",
    "HostPagesHandle",
    "Layout",
    "MAX_DIMS",
    "MAX_TENSORS",
    "TensorDesc",
    "block_views",
    "check_imported",
    "layer_attention",
    "num_blocks",
    "parse_dtype",
    "process_start_time",
    "validate_registration",
]


#: Tensors of one registration (two per layer for 4096 layers) and dimensions of one tensor. Checked from a
#: list's header when a registration or a pages file's table is decoded, before any item is built: anyone may
#: register, so what a registration makes the Manager build is bounded.
MAX_TENSORS = 8192
MAX_DIMS = 8
#: A tensor's shape or strides as a registration or a pages file declares them.
Dims = Annotated[list[int], msgspec.Meta(max_length=MAX_DIMS)]


class GeometryError(OrbitKVError, ValueError):
    """A registration does not describe its tensors correctly. ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Layout(str, enum.Enum):
    VLLM_PACKED = "vllm_packed"
    SEPARATE = "separate"
    SGLANG_TOKEN_POOL = "sglang_token_pool"
    MLA = "mla"
    STATE = "state"


class AttentionKind(str, enum.Enum):
    MHA = "mha"
    GQA = "gqa"
    MLA = "mla"
    RECURRENT = "recurrent"


_ROLES_BY_LAYOUT: dict[Layout, tuple[str, ...]] = {
    Layout.VLLM_PACKED: ("kv",),
    Layout.SEPARATE: ("key", "value"),
    Layout.SGLANG_TOKEN_POOL: ("key", "value"),
    Layout.MLA: ("opaque",),
    Layout.STATE: ("opaque",),
}


class HostPagesHandle(msgspec.Struct, frozen=True, tag="host"):
    """A tensor in a host "engine pages" shared-memory file (see :mod:`orbitkv_fs.pages`)."""

    path: str
    offset: int


class CudaIpcHandle(msgspec.Struct, frozen=True, tag="cuda_ipc"):
    """A tensor in another process's GPU allocation: ``cudaIpcMemHandle_t`` bytes plus the tensor's byte
    offset inside that allocation (torch: ``storage._share_cuda_()`` handle and ``storage_offset``)."""

    handle: bytes
    offset: int
    device: int = 0
    #: Bytes of the shared allocation (torch: the storage's size); bounds the tensor's extent.
    size: int = 0


class TensorDesc(msgspec.Struct, frozen=True):
    """One KV tensor of one layer, as the engine declares it. ``strides`` are in elements."""

    layer: int
    role: str
    layout: str
    shape: Dims
    strides: Dims
    dtype: str
    handle: HostPagesHandle | CudaIpcHandle
    name: str = ""


class EngineRegistration(msgspec.Struct, frozen=True):
    """What an engine (one TP/PP rank of it) registers. Layers are global layer indices; this rank holds
    ``layer_start <= layer < layer_end`` of ``num_layers``."""

    model: str
    num_layers: int
    layer_start: int
    layer_end: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    tensors: Annotated[list[TensorDesc], msgspec.Meta(max_length=MAX_TENSORS)]
    attention: str = "gqa"
    model_revision: str = ""
    engine_kind: str = "generic"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    #: Codec for this engine; ``None`` takes the Manager's ``--storage-codec``.
    codec: str | None = None
    rotation_seed: int = 0
    #: False when the adapter cannot vouch for the head layout (then every layer is stored exact).
    head_layout_verified: bool = True
    #: The adapter would place pages first; codec-enabled instances store per layer regardless.
    page_first: bool = False
    engine_id: str | None = None
    #: The engine's process id (same host; connectors send ``os.getpid()``). The Manager watches that
    #: process and unregisters the engine when it exits. ``None``: not watched (DELETE it yourself).
    pid: int | None = None
    #: :func:`process_start_time` of ``pid`` as the engine read it; the Manager watches only when the
    #: process it sees under ``pid`` started then (another PID namespace, or a reused pid, would not).
    #: ``None``: the Manager reads it itself at registration.
    pid_start_time: int | None = None
    #: Let other processes of the registering OS user look this engine up (lease-free lookups only)
    #: without its credential: an engine whose scheduler is another process than the worker that
    #: registered (vLLM). Everything else still needs the credential (docs/security.md).
    lookup_by_user: bool = False


def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks after boot, field 22 of ``/proc/PID/stat``) of the process ``pid`` while it
    runs; None when there is no such process, it has exited (a zombie), or there is no ``/proc``."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields 3.. follow its last ")".
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def parse_dtype(name: str, field: str = "dtype") -> np.dtype:
    """numpy dtype of a dtype name (``bfloat16``, ``float16``, ``torch.bfloat16``, ...)."""
    import ml_dtypes

    n = name.removeprefix("torch.").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
               "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
    n = aliases.get(n, n)
    try:
        dt = np.dtype(getattr(ml_dtypes, n)) if n in ("bfloat16", "float8_e4m3fn", "float8_e5m2") else np.dtype(n)
        dtype_code(dt)
    except Exception:
        raise GeometryError(field, f"unsupported dtype {name!r}") from None
    return dt


def layer_attention(reg: EngineRegistration, desc: TensorDesc) -> AttentionKind:
    """Attention kind of the layer ``desc`` belongs to: MLA/state layouts override the engine's kind."""
    if desc.layout == Layout.MLA.value:
        return AttentionKind.MLA
    if desc.layout == Layout.STATE.value:
        return AttentionKind.RECURRENT
    return AttentionKind(reg.attention)


def _expected_shape(reg: EngineRegistration, desc: TensorDesc, layout: Layout) -> list[int | None]:
    t, h, d = reg.block_size, reg.num_heads, reg.head_dim
    if layout == Layout.VLLM_PACKED:
        return [None, h, t, 2 * d]
    if layout == Layout.SEPARATE:
        return [None, t, h, d]
    if layout == Layout.SGLANG_TOKEN_POOL:
        return [None, h, d]
    if layout == Layout.MLA:
        return [None, t, d]
    return [None] * len(desc.shape)  # state: any shape, one slot per leading index


def validate_registration(reg: EngineRegistration) -> None:
    """Every check that needs no imported tensor. Raises :class:`GeometryError` naming the field."""
    if not reg.model:
        raise GeometryError("model", "must name the model")
    for f in ("num_layers", "block_size", "num_heads", "head_dim", "tp_size", "pp_size"):
        if getattr(reg, f) <= 0:
            raise GeometryError(f, f"must be positive, got {getattr(reg, f)}")
    if not 0 <= reg.layer_start < reg.layer_end <= reg.num_layers:
        raise GeometryError("layer_start", f"stage range [{reg.layer_start}, {reg.layer_end}) not inside "
                            f"[0, {reg.num_layers})")
    if reg.num_layers > 0xFFFF:
        raise GeometryError("num_layers", "at most 65535 layers")
    if not 0 <= reg.tp_rank < reg.tp_size:
        raise GeometryError("tp_rank", f"{reg.tp_rank} not in [0, {reg.tp_size})")
    if not 0 <= reg.pp_rank < reg.pp_size:
        raise GeometryError("pp_rank", f"{reg.pp_rank} not in [0, {reg.pp_size})")
    try:
        AttentionKind(reg.attention)
    except ValueError:
        raise GeometryError("attention", f"unknown attention kind {reg.attention!r}; expected "
                            f"{', '.join(k.value for k in AttentionKind)}") from None
    engine_dtype = parse_dtype(reg.dtype)
    if reg.engine_id is not None and not (0 < len(reg.engine_id) <= 128 and reg.engine_id.isprintable()):
        raise GeometryError("engine_id", "must be 1-128 printable characters")
    if reg.pid is not None and not 0 < reg.pid < 1 << 22:  # PID_MAX_LIMIT
        raise GeometryError("pid", f"{reg.pid} is not a process id")
    if reg.pid_start_time is not None and (reg.pid is None or reg.pid_start_time < 0):
        raise GeometryError("pid_start_time", "goes with pid, and is >= 0")
    if not reg.tensors:
        raise GeometryError("tensors", "no tensors registered")
    seen: dict[int, set[str]] = {}
    for i, desc in enumerate(reg.tensors):
        at = f"tensors[{i}]"
        if not reg.layer_start <= desc.layer < reg.layer_end:
            raise GeometryError(f"{at}.layer", f"layer {desc.layer} outside this stage's range "
                                f"[{reg.layer_start}, {reg.layer_end})")
        try:
            layout = Layout(desc.layout)
        except ValueError:
            raise GeometryError(f"{at}.layout", f"unknown layout {desc.layout!r}; expected "
                                f"{', '.join(x.value for x in Layout)}") from None
        if desc.role not in _ROLES_BY_LAYOUT[layout]:
            raise GeometryError(f"{at}.role", f"role {desc.role!r} is not one of {_ROLES_BY_LAYOUT[layout]} "
                                f"for layout {layout.value}")
        roles = seen.setdefault(desc.layer, set())
        if desc.role in roles:
            raise GeometryError(f"{at}.role", f"layer {desc.layer} registers role {desc.role!r} twice")
        roles.add(desc.role)
        dt = parse_dtype(desc.dtype, f"{at}.dtype")
        if layout not in (Layout.STATE,) and dt != engine_dtype:
            raise GeometryError(f"{at}.dtype", f"{dt} differs from the engine dtype {engine_dtype}")
        if len(desc.strides) != len(desc.shape):
            raise GeometryError(f"{at}.strides", f"{len(desc.strides)} strides for {len(desc.shape)} dims")
        if any(s <= 0 for s in desc.shape):
            raise GeometryError(f"{at}.shape", f"non-positive extent in {desc.shape}")
        if any(s < 0 for s in desc.strides):
            raise GeometryError(f"{at}.strides", f"negative stride in {desc.strides}")
        expect = _expected_shape(reg, desc, layout)
        if len(expect) != len(desc.shape) or len(desc.shape) < 1:
            raise GeometryError(f"{at}.shape", f"{layout.value} needs {len(expect)} dims, got {desc.shape}")
        names = _DIM_NAMES[layout]
        for j, (want, got) in enumerate(zip(expect, desc.shape)):
            if want is not None and want != got:
                raise GeometryError(f"{at}.shape[{j}]", f"{names[j]} is {got}, the registration declares {want}")
        if layout == Layout.SGLANG_TOKEN_POOL and desc.shape[0] < reg.block_size:
            raise GeometryError(f"{at}.shape[0]", f"token pool of {desc.shape[0]} holds no whole page")
    for layer in range(reg.layer_start, reg.layer_end):
        roles = seen.get(layer)
        if not roles:
            raise GeometryError("tensors", f"layer {layer} has no tensor")
        if roles & {"key", "value"} and roles != {"key", "value"}:
            raise GeometryError("tensors", f"layer {layer} registers {sorted(roles)}; key and value go together")
    counts = {num_blocks(reg, d) for d in reg.tensors if d.layout != Layout.STATE.value}
    if len(counts) > 1:
        raise GeometryError("tensors", f"tensors disagree on the number of blocks: {sorted(counts)}")


_DIM_NAMES = {
    Layout.VLLM_PACKED: ("num_blocks", "num_heads", "block_size", "2*head_dim"),
    Layout.SEPARATE: ("num_blocks", "block_size", "num_heads", "head_dim"),
    Layout.SGLANG_TOKEN_POOL: ("num_tokens", "num_heads", "head_dim"),
    Layout.MLA: ("num_blocks", "block_size", "head_dim (latent width)"),
    Layout.STATE: tuple(f"dim{i}" for i in range(16)),
}


def num_blocks(reg: EngineRegistration, desc: TensorDesc) -> int:
    """Blocks (pages, or state slots) ``desc`` holds."""
    if desc.layout == Layout.SGLANG_TOKEN_POOL.value:
        return desc.shape[0] // reg.block_size
    return desc.shape[0]


def check_imported(desc: TensorDesc, field: str, *, dtype: np.dtype, shape: tuple[int, ...],
                   strides: tuple[int, ...], role: str | None) -> None:
    """``desc`` against what the import found. ``strides`` in elements; ``role`` None where the
    import carries no role tag (CUDA IPC)."""
    if np.dtype(dtype) != parse_dtype(desc.dtype, f"{field}.dtype"):
        raise GeometryError(f"{field}.dtype", f"declared {desc.dtype}, the imported tensor is {np.dtype(dtype)}")
    if tuple(shape) != tuple(desc.shape):
        raise GeometryError(f"{field}.shape", f"declared {list(desc.shape)}, the imported tensor is {list(shape)}")
    if tuple(strides) != tuple(desc.strides):
        raise GeometryError(f"{field}.strides", f"declared {list(desc.strides)}, the imported tensor has "
                            f"{list(strides)}")
    if role is not None and role != desc.role:
        raise GeometryError(f"{field}.role", f"declared {desc.role!r}, the imported tensor is tagged {role!r}")


def block_views(reg: EngineRegistration, desc: TensorDesc, array, block: int) -> list[tuple[Role, object]]:
    """``(role, view)`` of block ``block`` of ``array`` (a numpy or cupy array shaped like ``desc``)."""
    layout = Layout(desc.layout)
    if layout == Layout.VLLM_PACKED:
        d = reg.head_dim
        return [(Role.KEY, array[block, :, :, :d]), (Role.VALUE, array[block, :, :, d:])]
    if layout == Layout.SGLANG_TOKEN_POOL:
        t = reg.block_size
        return [(Role.parse(desc.role), array[block * t:(block + 1) * t])]
    return [(Role.parse(desc.role), array[block])]

