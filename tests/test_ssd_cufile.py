"""The SSD tier over cuFile (kvikio; compatibility mode without a GDS driver). GPU machines only."""

from __future__ import annotations

import pytest

from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from test_ssd_common import direct_io_dir, flip, key, segment

pytestmark = pytest.mark.gpu


def test_cufile_tier_roundtrip_corruption_and_recovery(tmp_path):
    d = direct_io_dir(tmp_path)
    paths = (str(d / "g0.okv"), str(d / "g1.okv"))
    with SsdTier(SsdConfig(paths=paths, capacity=64 << 20, backend="cufile")) as t:
        assert t.snapshot().backend == "cufile"
        for i in range(32):
            assert t.submit(key(i), segment(i))
        t.flush()
        assert t.read_many([key(i) for i in range(32)]) == [segment(i) for i in range(32)]
        o = next(o for o in t.iter_records() if o.key == key(7))
        flip(paths[o.shard], o.offset + 128 + 64 + 3)
        assert t.read(key(7)) is None and t.snapshot().corrupt_records_total == 1
    with SsdTier(SsdConfig(paths=paths, capacity=64 << 20, backend="cufile", recover=True)) as t:
        assert t.snapshot().objects == 31
        assert t.read(key(3)) == segment(3)


def test_cufile_ring_moves_device_buffers(tmp_path):
    import cupy as cp

    from orbitkv_fs.tiers.ssd.cufile import CuFileBackend

    d = direct_io_dir(tmp_path)
    b = CuFileBackend()
    fid = b.open(str(d / "dev.okv"), 8 << 20, truncate=True)
    ring = b.ring(4)
    src = cp.arange(1 << 20, dtype=cp.uint8)
    ring.prep_write(fid, src, 4096, 1)
    ring.submit()
    assert ring.wait(10.0) == [(1, 1 << 20)]
    dst = cp.zeros(1 << 20, dtype=cp.uint8)
    ring.prep_read(fid, dst, 4096, 2)
    ring.submit()
    assert ring.wait(10.0) == [(2, 1 << 20)]
    assert bool((dst == src).all())
    ring.close()
    b.close()
