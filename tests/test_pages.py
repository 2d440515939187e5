"""Engine pages files: opening follows no symlink, reads a table over several header pages, and refuses
tables that lie about the file or are bigger than any engine's."""

import os

import msgspec
import pytest

from orbitkv_fs.pages import HostPages, PagesError, PageTensor


def test_open_refuses_a_symlink(tmp_path):
    p = HostPages.create([("a", (4, 4), "float16", "opaque")], directory=str(tmp_path))
    try:
        link = tmp_path / "link"
        os.symlink(p.path, link)
        with pytest.raises(PagesError, match="cannot open"):
            HostPages.open(str(link))
        q = HostPages.open(p.path)
        q.close()
    finally:
        p.close()


@pytest.mark.parametrize("layers", [36, 80, 200])
def test_a_table_of_many_tensors_spans_several_header_pages(tmp_path, layers):
    """Qwen3-8B with separate K and V is 72 tensors; 80 layers (160) and 200 (400) need several 4 KiB
    header pages. Every tensor must reopen where it was created, and the Manager must register them all."""
    from orbitkv_fs.geometry import EngineRegistration
    from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
    from orbitkv_fs.pages import ALIGN, HEADER_BYTES, host_engine_pages

    pages, descs = host_engine_pages(num_layers=layers, num_blocks=2, block_size=16, num_heads=8, head_dim=128,
                                     layout="separate", directory=str(tmp_path))
    try:
        assert len(pages.tensors) == 2 * layers
        first = min(t.offset for t in pages.tensors.values())
        assert first % ALIGN == 0
        if layers >= 80:
            assert first > HEADER_BYTES  # the table did not fit one page
        for i, t in enumerate(pages.tensors.values()):
            pages.array(t.name)[...] = i
        again = HostPages.open(pages.path)
        try:
            assert again.tensors == pages.tensors
            for i, t in enumerate(again.tensors.values()):
                assert (again.array(t.name) == i).all()
        finally:
            again.close()
        reg = EngineRegistration(model="m", num_layers=layers, layer_start=0, layer_end=layers, block_size=16,
                                 num_heads=8, head_dim=128, dtype="bfloat16", tensors=descs)
        with Manager(ManagerConfig(pool_size=64 << 20, device="cpu")) as m:
            e = m.register_engine(reg)
            assert e.segments_per_chunk == 2 * layers
            key = bytes(range(16))
            assert m.save(e.engine_id, [ChunkBlocks(key, [0])]).chunks_saved == 1
            assert m.restore(e.engine_id, [ChunkBlocks(key, [1])]).restored == [True]
            last = pages.array(f"L{layers - 1}.value")
            assert (last[1] == last[0]).all() and (last[1] == 2 * layers - 1).all()
    finally:
        pages.close()


def test_a_header_page_count_that_does_not_add_up_is_refused(tmp_path):
    """A file whose table claims more bytes than the file holds is not an engine pages file."""
    import struct

    p = HostPages.create([(f"t{i}", (4, 4), "float16", "opaque") for i in range(300)], directory=str(tmp_path))
    try:
        size = os.path.getsize(p.path)
        with open(p.path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", size))
        with pytest.raises(PagesError, match="not an engine pages file"):
            HostPages.open(p.path)
    finally:
        p.close()


@pytest.mark.parametrize("table, why", [
    (b"\x00" * ((4 << 20) + 1), "a tensor table of 4194305 bytes"),
    (msgspec.msgpack.encode([PageTensor("t", 0, [1], [1], "float16", "opaque")] * 8193), "length <= 8192"),
    (msgspec.msgpack.encode([PageTensor("t", 0, [1] * 9, [1] * 9, "float16", "opaque")]), "length <= 8"),
])
def test_a_table_bigger_than_any_engine_is_refused_before_it_is_built(tmp_path, table, why):
    """Anyone may register their own pages file: a table longer than MAX_TABLE_BYTES, of more than
    MAX_TENSORS tensors or with a tensor of more than MAX_DIMS dimensions is refused from its header and its
    lists' headers. Without the bounds such a table is built whole (about 7 bytes of objects a byte of table,
    with a table of up to 4 GiB) before it is refused."""
    from orbitkv_fs.pages import _HDR, ALIGN, MAGIC, VERSION

    path = tmp_path / "forged"
    size = -(-(_HDR.size + len(table)) // ALIGN) * ALIGN + ALIGN
    with open(path, "wb") as f:
        f.write(_HDR.pack(MAGIC, VERSION, len(table)) + table)
        f.truncate(size)
    with pytest.raises(PagesError, match=why):
        HostPages.open(str(path))
