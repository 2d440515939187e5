"""Addresses of host buffers, for the copies the GPU engine queues from them.

``numpy``'s ``.ctypes.data`` builds a ctypes object per call; the restore and save paths ask for an address
per segment, so :func:`host_address` takes the buffer protocol's pointer through a one-byte ctypes view
instead (3.65 against 0.68 us a call, ``docs/results/2026-11-30-pipeline-gpu-7/micro.py``), falling back
to numpy for buffers ctypes refuses (read-only, empty).
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
