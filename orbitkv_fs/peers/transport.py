"""The Transfer Engine seam: a thin wrapper over Mooncake's ``mooncake.engine.TransferEngine``.

Each :class:`Transport` owns one engine, started with P2P handshake metadata (no etcd): its session id is
``host:rpc_port`` and a reader reaches a peer's registered memory with that id alone. Primitives:

* :class:`Transport` -- ``register`` / ``unregister`` host memory, ``submit_read`` (one-sided read of a
  peer's registered bytes into local memory, asynchronous) and ``poll`` (non-blocking completion).
* :func:`transport_available` -- whether ``mooncake`` imports on this machine.

Invariants:

* ``mooncake`` is imported lazily, on the first :class:`Transport`; ``orbitkv_fs`` imports without it.
* Starting an engine leaves the process's SIGINT/SIGTERM handlers as they were (the engine replaces them
  with its own exit(1) handlers; :class:`Transport` puts them back when started on the main thread).
* A submitted read is tracked until :meth:`Transport.poll` reports it terminal (done or failed). The
  caller must keep the destination memory alive (and unused) until then, even if it stopped waiting:
  an abandoned read can still land bytes there. The engine itself gives up after its own timeout
  (``MC_TRANSFER_TIMEOUT``, 30 s by default, 5 s at least).
* Every engine error is a :class:`TransportError`; nothing else escapes for bad session ids, unregistered
  addresses or dead peers.
"""

from __future__ import annotations

import logging
import signal
import threading

from ..errors import OrbitKVError

__all__ = ["Transport", "TransportError", "TransportUnavailable", "transport_available", "READ_DONE",
           "READ_FAILED", "READ_PENDING"]

log = logging.getLogger(__name__)

READ_PENDING, READ_DONE, READ_FAILED = 0, 1, -1
_P2P = "P2PHANDSHAKE"


class TransportError(OrbitKVError):
    """The Transfer Engine refused or failed an operation."""


class TransportUnavailable(TransportError):
    """``mooncake`` (or the libibverbs/libfabric it links) is not installed here."""


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # also the OSError-like ImportError of a missing libibverbs.so.1
        raise TransportUnavailable(
            f"mooncake Transfer Engine unavailable ({e}); install mooncake-transfer-engine-efa-non-cuda "
            "(CPU hosts, with Debian's libibverbs1 and libfabric1) or the CUDA build") from e
    return TransferEngine


def transport_available() -> bool:
    try:
        _engine_class()
    except TransportUnavailable:
        return False
    return True


def _restore_signal_handlers(saved: dict) -> None:
    # The engine installs C-level SIGINT/SIGTERM handlers that exit(1) at once, bypassing the process's
    # own orderly shutdown (and Python's handlers); give the process its handlers back.
    if threading.current_thread() is not threading.main_thread():
        log.warning("Transfer Engine started off the main thread: its SIGINT/SIGTERM handlers stay installed")
        return
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


class Transport:
    """One Transfer Engine. Thread-safe: the engine releases the GIL and locks internally."""

    def __init__(self, hostname: str = "127.0.0.1", *, protocol: str = "tcp", device: str = "") -> None:
        engine = _engine_class()()
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        rc = engine.initialize(hostname, _P2P, protocol, device)
        _restore_signal_handlers(saved)
        if rc != 0:
            raise TransportError(f"TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) -> {rc}")
        self._engine = engine
        self.hostname = hostname
        self.protocol = protocol
        #: What peers pass as ``target_hostname`` to read this engine's registered memory.
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}
        self._pending: set[int] = set()

    def register(self, address: int, size: int) -> None:
        """Make ``[address, address+size)`` of this process readable by peers (and a read destination)."""
        if address <= 0 or size <= 0:
            raise TransportError(f"cannot register address={address:#x} size={size}")
        rc = self._engine.register_memory(address, size)
        if rc != 0:
            raise TransportError(f"register_memory({address:#x}, {size}) -> {rc}")
        with self._lock:
            self._regions[address] = size

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._regions.pop(address, None) is None:
                raise TransportError(f"{address:#x} is not a registered region")
        self._engine.unregister_memory(address)

    def submit_read(self, session_id: str, local: int, remote: int, length: int) -> int:
        """Start reading ``length`` bytes at the peer's ``remote`` address into ``local``. Returns a
        handle for :meth:`poll`. Raises :class:`TransportError` when the engine refuses at once
        (unreachable peer, bad session id)."""
        # One entry per batch: the engine's non-blocking status call reports a batch's first task only.
        handle = self._engine.batch_transfer_async_read(session_id, [local], [remote], [length])
        # 0 (submit failed) and -1 as unsigned (openSegment failed) are the engine's error values.
        if handle in (0, (1 << 64) - 1, -1):
            raise TransportError(f"read of {length} bytes from {session_id} could not be submitted")
        with self._lock:
            self._pending.add(handle)
        return handle

    def poll(self, handle: int) -> int:
        """:data:`READ_PENDING`, :data:`READ_DONE` or :data:`READ_FAILED` (terminal states free the handle;
        polling a handle again after that raises :class:`TransportError`)."""
        # The status call and the forget are one step under the lock: a terminal status frees the engine's
        # batch, whose address another thread's submit_read may get back at once as its own handle.
        with self._lock:
            if handle not in self._pending:
                raise TransportError(f"unknown or finished transfer handle {handle}")
            s = self._engine.transfer_check_status(handle)
            if s == 0 or s == -2:
                # The engine's TIMEOUT state (-2) does not free the batch: it stays pending until FAILED.
                return READ_PENDING
            self._pending.discard(handle)
        return READ_DONE if s == 1 else READ_FAILED

    def read(self, session_id: str, local: int, remote: int, length: int) -> None:
        """Blocking read (the engine's own timeout applies). Raises :class:`TransportError`."""
        rc = self._engine.transfer_sync_read(session_id, local, remote, length)
        if rc != 0:
            raise TransportError(f"read of {length} bytes from {session_id} failed ({rc})")

    def read_batch(self, session_id: str, locals_: list[int], remotes: list[int], lengths: list[int]) -> None:
        """Blocking batch read (the raw engine path benchmarks compare against)."""
        rc = self._engine.batch_transfer_sync_read(session_id, locals_, remotes, lengths)
        if rc != 0:
            raise TransportError(f"batch read of {len(lengths)} extents from {session_id} failed ({rc})")

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
