"""The SSD tier: a log-structured ring of authenticated records per shard file, io_uring writeback, cuFile.

Public API: :class:`SsdTier` (the Manager's lower tier), :class:`SsdConfig`, :class:`SsdStats`,
:class:`SsdObject`. Modules: the on-disk formats in :mod:`.record` (records, tombstones) and
:mod:`.superblock`; the recovery scan in :mod:`.recovery` (shared with ``orbitkv-inspect``); the ring in
:mod:`.ring`; the index in :mod:`.index`; the writeback lane in :mod:`.lane`; the read path in
:mod:`.reads`; staging buffers in :mod:`.staging`; I/O engines in :mod:`.uring` (io_uring) and
:mod:`.cufile` (kvikio); fault injection for tests in :mod:`.faults`; a start that a disk which does not
answer cannot hold in :mod:`.start` (:func:`~.start.open_tier`).
"""

from .lane import GenerationsExhausted
from .record import BLOCK, RECORD_HEADER_SIZE
from .recovery import Fate, RecordInfo, ShardRecovery, Status, recover_shard
from .superblock import RING_START
from .tier import SsdConfig, SsdConfigError, SsdObject, SsdStats, SsdTier
from .uring import SsdIoError, UringBackend

__all__ = [
    "BLOCK",
    "Fate",
    "GenerationsExhausted",
    "RECORD_HEADER_SIZE",
    "RING_START",
    "RecordInfo",
    "ShardRecovery",
    "SsdConfig",
    "SsdConfigError",
    "SsdIoError",
    "SsdObject",
    "SsdStats",
    "SsdTier",
    "Status",
    "UringBackend",
    "recover_shard",
]
