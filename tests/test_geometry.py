"""Registration validation against imported host pages, and namespace v2."""

from __future__ import annotations

import msgspec
import pytest

from orbitkv_fs.geometry import EngineRegistration, GeometryError, HostPagesHandle, TensorDesc
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.namespace import namespace_v2
from orbitkv_fs.pages import HostPages, host_engine_pages

L, B, T, H, D = 4, 8, 16, 2, 64


@pytest.fixture
def pages():
    p, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D)
    yield p, descs
    p.close()


@pytest.fixture
def manager():
    with Manager(ManagerConfig(pool_size=1 << 20)) as m:
        yield m


def reg_of(descs, **kw) -> EngineRegistration:
    base = dict(model="m", num_layers=L, layer_start=0, layer_end=L, block_size=T, num_heads=H, head_dim=D,
                dtype="bfloat16", tensors=descs)
    base.update(kw)
    return EngineRegistration(**base)


def bad(descs, i, **changes):
    out = list(descs)
    out[i] = msgspec.structs.replace(descs[i], **changes)
    return out


@pytest.mark.parametrize("make,field", [
    (lambda d: reg_of(d, head_dim=128), "tensors[0].shape[3]"),  # declared head dim vs the tensor shape
    (lambda d: reg_of(d, num_heads=4), "tensors[0].shape[2]"),
    (lambda d: reg_of(bad(d, 1, role="key")), "tensors[1].role"),  # K registered twice for layer 0
    (lambda d: reg_of(bad(d, 0, role="kv")), "tensors[0].role"),
    (lambda d: reg_of(bad(d, 2, layer=9)), "tensors[2].layer"),
    (lambda d: reg_of(d[:-2]), "tensors"),  # layer 3 missing
    (lambda d: reg_of(d, layer_start=2, layer_end=1), "layer_start"),
    (lambda d: reg_of(d, tp_rank=2, tp_size=2), "tp_rank"),
    (lambda d: reg_of(d, attention="sliding"), "attention"),
    (lambda d: reg_of(d, codec="zstd"), "codec"),
    (lambda d: reg_of(bad(d, 0, layout="paged")), "tensors[0].layout"),
])
def test_static_errors_name_the_field(pages, manager, make, field):
    _, descs = pages
    with pytest.raises(GeometryError) as ei:
        manager.register_engine(make(descs))
    assert ei.value.field == field
    assert manager.list_engines() == []


@pytest.mark.parametrize("change,field", [
    (dict(dtype="float16"), "tensors[0].dtype"),  # declared fp16, the pages hold bf16
    (dict(strides=[2048, 128, 1, 2]), "tensors[0].strides"),  # heads and head_dim swapped
    (dict(role="value"), "tensors[0].role"),
])
def test_imported_tensor_mismatch_registers_nothing(pages, manager, change, field):
    p, descs = pages
    d = bad(descs, 0, **change)
    if "role" in change:  # swap both, so only the import can tell
        d = bad(d, 1, role="key")
    reg = reg_of(d, dtype=change.get("dtype", "bfloat16"))
    if "dtype" in change:
        reg = reg_of([msgspec.structs.replace(x, dtype="float16") for x in descs])
    with pytest.raises(GeometryError) as ei:
        manager.register_engine(reg)
    assert ei.value.field == field
    assert manager.list_engines() == []


def test_bad_handles(pages, manager):
    p, descs = pages
    with pytest.raises(GeometryError) as ei:
        manager.register_engine(reg_of(bad(descs, 3, handle=HostPagesHandle(p.path, 12345))))
    assert ei.value.field == "tensors[3].handle.offset"
    with pytest.raises(GeometryError) as ei:
        manager.register_engine(reg_of(bad(descs, 0, handle=HostPagesHandle("/dev/shm/does-not-exist", 4096))))
    assert ei.value.field == "tensors[0].handle.path"
    with open(p.path, "r+b") as f:  # a file that lies about its table is refused
        f.write(b"XXXX")
    with pytest.raises(GeometryError):
        manager.register_engine(reg_of(descs))
    assert manager.list_engines() == []


def test_register_ok_and_engine_ids(pages, manager):
    _, descs = pages
    info = manager.register_engine(reg_of(descs, engine_id="e1"))
    assert info.engine_id == "e1" and info.segments_per_chunk == 2 * L and info.num_blocks == B
    assert len(info.credential) == 64  # the registration's answer alone carries the credential
    assert manager.get_engine("e1") == msgspec.structs.replace(info, credential="")
    with pytest.raises(Exception, match="already registered"):
        manager.register_engine(reg_of(descs, engine_id="e1"))
    assert [e.engine_id for e in manager.list_engines()] == ["e1"]


def test_namespace_v2_hashes_what_changes_bytes(pages):
    _, descs = pages
    base = reg_of(descs)
    ns = namespace_v2(base, "none")
    assert len(ns) == 16 and ns == namespace_v2(reg_of(descs), "none")
    other, _ = host_engine_pages(num_layers=L, num_blocks=2 * B, block_size=T, num_heads=H, head_dim=D)
    try:
        assert namespace_v2(reg_of([other.descriptor(t) for t in other.tensors]), "none") == ns  # block count
    finally:
        other.close()
    assert namespace_v2(reg_of(descs, dtype="bf16"), "none") == ns  # dtype spelling
    for changed in (dict(model="m2"), dict(model_revision="r2"), dict(tp_rank=1, tp_size=2),
                    dict(pp_rank=1, pp_size=2), dict(block_size=32), dict(head_layout_verified=False)):
        assert namespace_v2(reg_of(descs, **changed), "none") != ns, changed
    assert namespace_v2(base, "fp8") != ns
    assert namespace_v2(reg_of(descs, rotation_seed=5), "turboquant-4") != namespace_v2(base, "turboquant-4")


def test_pages_table_validated(tmp_path):
    p = HostPages.create([("a", (4, 4), "float16", "opaque")], directory=str(tmp_path))
    try:
        q = HostPages.open(p.path)
        assert q.at(p.tensors["a"].offset)[1].shape == (4, 4)
        q.close()
        with open(p.path, "r+b") as f:
            f.truncate(4096 + 8)  # the tensor now runs past the end of the file
        with pytest.raises(Exception, match="past the end"):
            HostPages.open(p.path)
    finally:
        p.close()


def test_desc_is_a_wire_type():
    d = TensorDesc(layer=0, role="key", layout="separate", shape=[1, 2, 3, 4], strides=[24, 12, 4, 1],
                   dtype="float16", handle=HostPagesHandle("/x", 4096))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=TensorDesc) == d
    assert msgspec.json.decode(msgspec.json.encode(d), type=TensorDesc) == d
