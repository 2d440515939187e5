"""Whole-chunk gather and scatter of engine blocks (``_Seg.gather`` / ``_Seg.scatter``, the GPU path's
one-launch-per-tensor moves) against the per-block views, on host pages of every block layout; and the
arena bookkeeping of segments the GPU engine writes in place (``_gaps``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.manager import Manager, ManagerConfig, _gaps
from orbitkv_fs.pages import host_engine_pages

L, B, T, H, D = 2, 12, 4, 2, 32


@pytest.mark.parametrize("blocks", [[7, 2, 11, 3], [4, 5, 6, 7], [9]], ids=["scattered", "run", "one"])
@pytest.mark.parametrize("layout", ["separate", "vllm_packed", "sglang_token_pool", "mla"])
def test_gather_and_scatter_match_block_views(layout, blocks):
    pages, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D, layout=layout)
    try:
        rng = np.random.default_rng(1)
        for name in pages.tensors:
            a = pages.array(name)
            a[...] = rng.standard_normal(a.shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        attention = "mla" if layout == "mla" else "gqa"
        reg = EngineRegistration(model="gs", num_layers=L, layer_start=0, layer_end=L, block_size=T, num_heads=H,
                                 head_dim=D, dtype="bfloat16", tensors=descs, attention=attention)
        with Manager(ManagerConfig(pool_size=8 << 20, device="cpu")) as m:
            e = m.register_engine(reg)
            for seg in m._engines[e.engine_id].segs:
                before = {b: np.array(seg.view(b)) for b in range(B)}
                got = seg.gather(blocks)
                assert got.flags.c_contiguous and got.shape == (len(blocks),) + seg.block_shape
                assert all(np.array_equal(got[j], before[b]) for j, b in enumerate(blocks))
                new = np.asarray(rng.standard_normal(got.shape, dtype=np.float32)).astype(got.dtype)
                seg.scatter(blocks, new)
                for b in range(B):  # the named blocks take the new values, no other block changes
                    want = new[blocks.index(b)] if b in blocks else before[b]
                    assert np.array_equal(seg.view(b), want), (layout, seg.layer, seg.role, b)
    finally:
        pages.close()


def test_gaps_partition_regions():
    regions = [(0, 8192), (16384, 2048)]
    used = [(512, 1024), (2048, 512), (16384, 2048)]
    gaps = _gaps(regions, used)
    assert gaps == [(0, 512), (1536, 512), (2560, 5632)]
    covered = sorted(used + gaps)
    assert sum(n for _, n in covered) == sum(n for _, n in regions)  # every unit freed or published once
    assert _gaps([(0, 4096)], []) == [(0, 4096)]
    assert _gaps([(0, 4096)], [(0, 4096)]) == []
