"""host_address against numpy's own answer, over the buffer kinds the save and restore paths hand it."""

import mmap

import numpy as np
import pytest

from orbitkv_fs.hostmem import host_address

_A = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
_RO = _A[10:20]
_RO.flags.writeable = False


@pytest.mark.parametrize("buf", [_A, _A[100:], memoryview(_A)[5:900], memoryview(_A[7:]).cast("B"),
                                 _A.view(np.uint16)[3:], bytearray(b"xyz"), b"abc", memoryview(b"abcdef")[2:],
                                 _A[:0], memoryview(_A)[3:3], _RO],
                         ids=["array", "array-slice", "memoryview-slice", "memoryview-cast", "uint16", "bytearray",
                              "bytes", "readonly-memoryview", "empty-array", "empty-memoryview", "readonly-array"])
def test_host_address_matches_numpy(buf):
    assert host_address(buf) == np.frombuffer(buf, np.uint8).ctypes.data


def test_host_address_of_a_shared_mapping():
    m = mmap.mmap(-1, 1 << 16)
    try:
        view = np.frombuffer(m, np.uint8)
        assert host_address(memoryview(view)[4096:8192]) == view.ctypes.data + 4096
        del view
    finally:
        m.close()  # no buffer export of host_address outlives the call


def test_host_address_refuses_a_strided_view():
    with pytest.raises(ValueError):
        host_address(_A[::2])
