"""Wire models of the HTTP control plane (pydantic): what each endpoint accepts and answers.

Request models are strict: unknown fields are rejected (``extra="forbid"``), JSON types are not coerced
(``strict=True``: ``"5"`` is not an int), strings and lists are bounded (:data:`MAX_TENSORS`,
:data:`MAX_KEYS`, ...), and nothing names a file-system path: a host-pages handle names a shared-memory
object (:data:`SHM_NAME`, no ``/``, no leading dot), resolved inside the Manager's ``--shm-dir`` by the
route. Primitives: :class:`RegisterRequest` (``to_registration`` builds the Manager's
:class:`~orbitkv_fs.geometry.EngineRegistration`), :class:`InvalidateRequest`, the response models, and
:func:`model_of_struct` (a response model mirroring a msgspec struct, so ``/v1/stats`` documents exactly
what :class:`~orbitkv_fs.manager.ManagerStats` holds and cannot drift from it).
"""

from __future__ import annotations

import base64
import binascii
import typing
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from orbitkv_fs.codecs import CODEC_NAMES
from orbitkv_fs.geometry import (
    MAX_DIMS,
    MAX_TENSORS,
    AttentionKind,
    CudaIpcHandle,
    EngineRegistration,
    HostPagesHandle,
    Layout,
    TensorDesc,
)

__all__ = [
    "ConfigOut", "CudaIpcHandleIn", "EngineList", "EngineOut", "FlushOut", "HealthOut", "HostHandleIn",
    "InvalidateOut", "InvalidateRequest", "ObjectOut", "ObjectPageOut", "ReadyOut", "RegisterRequest", "RegisteredOut",
    "TensorIn", "TierCountsOut", "model_of_struct",
]

MAX_KEYS = 10_000
MAX_CHUNKS = 10_000
MAX_OBJECTS_PAGE = 1000
#: A shared-memory object name: one path component, no leading dot (never ``..``), no separators.
SHM_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$"
#: An id a REST registration may ask for (URL-safe).
ENGINE_ID = r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}$"
#: An id naming an existing engine: whatever the data plane accepted too (1-128 printable characters).
ENGINE_REF = r"^[^\x00-\x1f\x7f]{1,128}$"
HEX16 = r"^[0-9a-f]{32}$"
OBJECT_KEY = r"^[0-9a-f]{32}/[0-9a-f]{32}/L[0-9]{1,5}/(opaque|key|value)$"
_CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------------------------- registration


class HostHandleIn(_Strict):
    """A tensor in a host engine-pages file (:mod:`orbitkv_fs.pages`) in the Manager's shared-memory
    directory, named like ``shm_open`` names: the object's name, never a path."""

    type: Literal["host"]
    name: str = Field(pattern=SHM_NAME, description="shared-memory object name (e.g. orbitkv-pages-1a2b3c), "
                      "resolved inside the Manager's --shm-dir; paths are refused",
                      examples=["orbitkv-pages-1a2b3c4d5e6f"])
    offset: int = Field(ge=0, lt=1 << 62, description="byte offset of the tensor inside the pages file")

    @model_validator(mode="before")
    @classmethod
    def _no_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            raise ValueError("handles name a shared-memory object ('name'), not a file-system path ('path')")
        return data


class CudaIpcHandleIn(_Strict):
    """A tensor in the engine's GPU memory: a CUDA IPC memory handle (base64) plus its byte offset."""

    type: Literal["cuda_ipc"]
    handle: str = Field(min_length=88, max_length=88, description="base64 of the 64-byte cudaIpcMemHandle_t")
    offset: int = Field(ge=0, lt=1 << 62)
    device: int = Field(default=0, ge=0, lt=1024)
    size: int = Field(default=0, ge=0, lt=1 << 62, description="bytes of the shared allocation (bounds the tensor)")

    @field_validator("handle")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            raw = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("handle must be base64") from None
        if len(raw) != _CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {_CUDA_IPC_HANDLE_BYTES} bytes")
        return v


_Extent = Annotated[int, Field(ge=1, lt=1 << 40)]
_Stride = Annotated[int, Field(ge=0, lt=1 << 48)]


class TensorIn(_Strict):
    """One KV tensor of one layer (:class:`orbitkv_fs.geometry.TensorDesc`); strides in elements."""

    layer: int = Field(ge=0, le=0xFFFF)
    role: Literal["kv", "key", "value", "opaque"]
    layout: Literal[tuple(x.value for x in Layout)]  # type: ignore[valid-type]
    shape: list[_Extent] = Field(min_length=1, max_length=MAX_DIMS)
    strides: list[_Stride] = Field(min_length=1, max_length=MAX_DIMS)
    dtype: str = Field(min_length=1, max_length=32, examples=["bfloat16"])
    handle: HostHandleIn | CudaIpcHandleIn = Field(discriminator="type")
    name: str = Field(default="", max_length=128)


class RegisterRequest(_Strict):
    """An engine (one TP/PP rank) registering its KV tensors (:class:`orbitkv_fs.geometry.EngineRegistration`)."""

    model: str = Field(min_length=1, max_length=256, examples=["HuggingFaceTB/SmolLM2-135M"])
    num_layers: int = Field(ge=1, le=0xFFFF)
    layer_start: int = Field(ge=0, le=0xFFFF)
    layer_end: int = Field(ge=1, le=0xFFFF)
    block_size: int = Field(ge=1, le=1 << 20)
    num_heads: int = Field(ge=1, le=1 << 16)
    head_dim: int = Field(ge=1, le=1 << 16)
    dtype: str = Field(min_length=1, max_length=32, examples=["bfloat16"])
    tensors: list[TensorIn] = Field(min_length=1, max_length=MAX_TENSORS)
    attention: Literal[tuple(x.value for x in AttentionKind)] = "gqa"  # type: ignore[valid-type]
    model_revision: str = Field(default="", max_length=256)
    engine_kind: str = Field(default="generic", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
    tp_rank: int = Field(default=0, ge=0, lt=1 << 16)
    tp_size: int = Field(default=1, ge=1, le=1 << 16)
    pp_rank: int = Field(default=0, ge=0, lt=1 << 16)
    pp_size: int = Field(default=1, ge=1, le=1 << 16)
    codec: Literal[tuple(CODEC_NAMES)] | None = Field(  # type: ignore[valid-type]
        default=None, description="codec for this engine; null takes the Manager's --storage-codec")
    rotation_seed: int = Field(default=0, ge=0, lt=1 << 64)
    head_layout_verified: bool = True
    page_first: bool = False
    engine_id: str | None = Field(default=None, pattern=ENGINE_ID,
                                  description="ask for this id (409 when taken); null: the Manager picks one")
    pid: int | None = Field(default=None, ge=1, lt=1 << 22, description=(
        "the engine's process id on the Manager's host: the Manager unregisters the engine when that "
        "process exits; null: never (DELETE it)"))
    pid_start_time: int | None = Field(default=None, ge=0, lt=1 << 63, description=(
        "start time of pid (clock ticks after boot, field 22 of /proc/PID/stat): the engine is watched "
        "only if the Manager sees pid with this start time; null: the Manager reads it at registration"))
    lookup_by_user: bool = Field(default=False, description=(
        "other processes of the registering OS user may look this engine up (lease-free) without its "
        "credential, e.g. a vLLM scheduler for its workers; every other call still needs the credential"))

    def to_registration(self, shm_path: typing.Callable[[str, str], str]) -> EngineRegistration:
        """The Manager's registration; ``shm_path(name, field)`` maps a handle's object name to the file
        the Manager opens (and raises for what it must refuse, naming ``field``)."""
        tensors = []
        for i, t in enumerate(self.tensors):
            h = t.handle
            if isinstance(h, HostHandleIn):
                handle: HostPagesHandle | CudaIpcHandle = HostPagesHandle(
                    shm_path(h.name, f"tensors[{i}].handle.name"), h.offset)
            else:
                handle = CudaIpcHandle(base64.b64decode(h.handle), h.offset, h.device, h.size)
            tensors.append(TensorDesc(layer=t.layer, role=t.role, layout=t.layout, shape=list(t.shape),
                                      strides=list(t.strides), dtype=t.dtype, handle=handle, name=t.name))
        fields = self.model_dump(exclude={"tensors"})
        return EngineRegistration(tensors=tensors, **fields)


class EngineOut(BaseModel):
    """A registered engine (handles are not echoed)."""

    engine_id: str
    namespace: str = Field(description="hex of the 16-byte storage namespace (v2)")
    codec: str
    model: str
    model_revision: str
    engine_kind: str
    num_layers: int
    layer_start: int
    layer_end: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    tensors: int
    segments_per_chunk: int
    exact_layers: list[int] = Field(description="layers stored exact whatever the codec")
    device: str = Field(description="host (shared-memory pages) or cuda:N")
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    pid: int | None = Field(None, description="the engine's process id, when it registered one")
    watched: bool = Field(False, description="the Manager checks that process and unregisters a dead engine")


class RegisteredOut(EngineOut):
    """The answer to a registration: the engine, and the credential every data-plane call for it must carry.
    Only this answer has it (docs/security.md)."""

    credential: str = Field(description="the engine's secret: RemoteClient.set_credential(engine_id, credential)")


class EngineList(BaseModel):
    engines: list[EngineOut]


# ---------------------------------------------------------------------------------------------- invalidate


class InvalidateRequest(_Strict):
    """Exactly one selector: ``keys``; ``namespace`` or ``engine_id`` (optionally narrowed to ``chunks``);
    or ``all``."""

    keys: list[Annotated[str, Field(pattern=OBJECT_KEY)]] | None = Field(
        default=None, min_length=1, max_length=MAX_KEYS,
        description="object keys as /v1/objects lists them: namespace/chunk/L<layer>/<role>")
    namespace: str | None = Field(default=None, pattern=HEX16, description="hex storage namespace")
    engine_id: str | None = Field(default=None, pattern=ENGINE_REF, description="an engine's namespace")
    chunks: list[Annotated[str, Field(pattern=HEX16)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHUNKS,
        description="hex chunk keys, with namespace or engine_id: only these chunks")
    all: bool = Field(default=False, description="everything in every tier")

    @model_validator(mode="after")
    def _one_selector(self) -> "InvalidateRequest":
        chosen = [n for n in ("keys", "namespace", "engine_id") if getattr(self, n) is not None]
        if self.all:
            chosen.append("all")
        if len(chosen) != 1:
            raise ValueError("give exactly one of keys, namespace, engine_id or all=true"
                             + (f" (got {', '.join(chosen)})" if chosen else ""))
        if self.chunks is not None and chosen[0] not in ("namespace", "engine_id"):
            raise ValueError("chunks go with namespace or engine_id")
        return self


class TierCountsOut(BaseModel):
    objects: int
    bytes: int = Field(description="stored bytes (header + payload)")


class InvalidateOut(BaseModel):
    tiers: dict[str, TierCountsOut] = Field(description="per tier (dram, and the lower tier's name): dropped")
    objects: int
    bytes: int


# ---------------------------------------------------------------------------------------------- admin


class FlushOut(BaseModel):
    submitted: TierCountsOut = Field(description="objects handed to the lower tier and written back")
    dropped: TierCountsOut = Field(description="objects the lower tier did not take (or there is none)")
    skipped_leased: int = Field(description="objects left in DRAM because a lease holds them")
    complete: bool = Field(description="false: the flush's deadline (60 s) passed before the lower tier took "
                                       "and wrote back everything (its disk does not answer)")


class ObjectOut(BaseModel):
    key: str = Field(description="namespace/chunk/L<layer>/<role>")
    tier: str
    format: str = Field(description="raw|ans|fp8|turboquant; empty for lower-tier rows (headers not read)")
    original_length: int
    stored_length: int
    generation: int


class ObjectPageOut(BaseModel):
    objects: list[ObjectOut]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last page")


class HealthOut(BaseModel):
    status: Literal["ok"]


class ReadyOut(BaseModel):
    status: Literal["ready"]
    engines: int
    lower_tier: str | None
    lower_tier_missing: str | None = Field(None, description="the lower tier the flags asked for, while none serves "
                                           "(its start was given up: --ssd-start-timeout); null otherwise")
    peers: bool


class HttpConfigOut(BaseModel):
    address: str
    auth_required: bool = Field(description="mutating and admin endpoints need the admin bearer token")
    max_body_bytes: int
    max_connections: int = Field(description="--http-max-connections: at the limit a new connection displaces the "
                                             "longest idle one")
    request_timeout_s: float = Field(description="--http-request-timeout: a request must arrive in full, and its "
                                                 "answer be taken, within this many seconds")


class ConfigOut(BaseModel):
    manager: dict[str, Any] = Field(description="the Manager's settings (ManagerConfig)")
    http: HttpConfigOut
    lower_tier: str | None
    peers: bool


# ---------------------------------------------------------------------------------------------- msgspec mirrors


def _annotation(tp: Any, cache: dict[type, type[BaseModel]]) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return model_of_struct(tp, cache)
    if origin in (list, dict) or origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = tuple(_annotation(a, cache) for a in typing.get_args(tp))
        if origin is list:
            return list[args[0]]  # type: ignore[valid-type]
        if origin is dict:
            return dict[args[0], args[1]]  # type: ignore[valid-type]
        return typing.Union[args]  # type: ignore[return-value]
    return tp


def model_of_struct(struct: type[msgspec.Struct], cache: dict[type, type[BaseModel]] | None = None,
                    *, name: str | None = None, extra: dict[str, Any] | None = None) -> type[BaseModel]:
    """A pydantic response model with ``struct``'s fields (nested structs mirrored too), plus ``extra``
    fields (``name: (type, default)``)."""
    cache = {} if cache is None else cache
    if struct in cache and extra is None:
        return cache[struct]
    hints = typing.get_type_hints(struct)
    fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(struct):
        ann = _annotation(hints[f.name], cache)
        if f.required:
            fields[f.name] = (ann, ...)
        elif f.default_factory is not msgspec.NODEFAULT:
            fields[f.name] = (ann, Field(default_factory=f.default_factory))
        else:
            fields[f.name] = (ann, f.default)
    fields.update(extra or {})
    model = create_model(name or struct.__name__, __doc__=struct.__doc__, **fields)
    if extra is None:
        cache[struct] = model
    return model
