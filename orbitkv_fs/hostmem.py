"""Addresses of host buffers, for the copies the GPU engine queues from them.

``numpy``'s ``.ctypes.data`` builds a ctypes object per call (about 3 us); the restore and save paths ask
for an address per segment, so :func:`host_address` takes the buffer protocol's pointer through a one-byte
ctypes view instead (about 0.3 us), falling back to numpy for buffers ctypes refuses (read-only, empty).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

_BYTE = ctypes.c_char


def host_address(buf: Any) -> int:
    """Address of the first byte of ``buf``, a C-contiguous host buffer (memoryview, numpy array,
    bytearray, bytes, mmap)."""
    try:
        return ctypes.addressof(_BYTE.from_buffer(buf))
    except (TypeError, ValueError, BufferError):  # read-only, empty or not contiguous: numpy says
        return int(np.frombuffer(buf, np.uint8).ctypes.data)
