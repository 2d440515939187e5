"""The SSD tier: a log-structured ring of validated records per shard file, io_uring writeback, cuFile.

Public API: :class:`SsdTier` (the Manager's lower tier), :class:`SsdConfig`, :class:`SsdStats`,
:class:`SsdObject`; record format and scanner in :mod:`.record`; I/O engines in
:mod:`.uring` (io_uring) and :mod:`.cufile` (kvikio); fault injection for tests in :mod:`.faults`.
"""

from .record import BLOCK, RECORD_HEADER_SIZE, ScanEntry, Status, scan
from .tier import SsdConfig, SsdConfigError, SsdObject, SsdStats, SsdTier
from .uring import SsdIoError, UringBackend

__all__ = [
    "BLOCK",
    "RECORD_HEADER_SIZE",
    "ScanEntry",
    "SsdConfig",
    "SsdConfigError",
    "SsdIoError",
    "SsdObject",
    "SsdStats",
    "SsdTier",
    "Status",
    "UringBackend",
    "scan",
]
