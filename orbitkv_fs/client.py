"""The client API connectors use: one interface, embedded or remote.

* :func:`connect` -- ``connect(manager)`` wraps an in-process :class:`~orbitkv_fs.manager.Manager`
  (embedded mode); ``connect("ipc:///...")`` or ``connect("tcp://127.0.0.1:PORT")`` talks to an
  ``orbitkv-cache-manager`` process over the data plane (:mod:`orbitkv_fs.dataplane`).
* :class:`Client` -- ``register``, ``unregister``, ``lookup``, ``save``, ``restore``, ``release``,
  ``invalidate``, ``stats``, ``close``: the same signatures, results and typed errors in both modes.

Credentials (docs/security.md): :meth:`Client.register` answers the engine's credential
(:attr:`~orbitkv_fs.manager.EngineInfo.credential`) and the client keeps it: every later call naming that
engine carries it, so code written against the client does not change. An engine registered some other
way (over REST) is made known with :meth:`Client.set_credential`. The embedded client checks the credential
of the engines it registered exactly as the remote mode does; a call naming an engine it did not register
runs as the in-process caller it is (the Manager lives in this process: there is no boundary to guard).

Invariants: both modes return the same msgspec result types and raise the same error classes (the data
plane carries the error's class name and message and the client re-raises it); a remote client is safe
to share between threads (each thread gets its own socket).
"""

from __future__ import annotations

from typing import Sequence

from .access import Caller, in_process_caller
from .keys import ObjectKey
from .manager import (
    ChunkBlocks,
    EngineInfo,
    EngineRegistration,
    InvalidateResult,
    LookupResult,
    Manager,
    ManagerStats,
    RestoreResult,
    SaveResult,
)

__all__ = ["Client", "EmbeddedClient", "connect"]


class Client:
    """The client API. Chunk keys are 16 bytes (:func:`orbitkv_fs.keys.chunk_key`)."""

    def register(self, reg: EngineRegistration) -> EngineInfo:
        raise NotImplementedError

    def unregister(self, engine_id: str) -> None:
        raise NotImplementedError

    def set_credential(self, engine_id: str, credential: str) -> None:
        """Calls naming ``engine_id`` (registered elsewhere, e.g. over REST) carry ``credential`` from now on."""
        raise NotImplementedError

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        raise NotImplementedError

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks]) -> SaveResult:
        raise NotImplementedError

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0,
                layers: Sequence[int] | None = None) -> RestoreResult:
        raise NotImplementedError

    def release(self, lease_id: int) -> None:
        raise NotImplementedError

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False) -> InvalidateResult:
        raise NotImplementedError

    def stats(self) -> ManagerStats:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddedClient(Client):
    """The Manager in this process; calls go straight through, with the credentials of the engines this
    client registered."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self._callers: dict[str, Caller] = {}

    def _caller(self, engine_id: str | None) -> Caller | None:
        return self._callers.get(engine_id) if engine_id is not None else None

    def set_credential(self, engine_id: str, credential: str) -> None:
        self._callers[engine_id] = in_process_caller(credential)

    def register(self, reg: EngineRegistration) -> EngineInfo:
        info = self.manager.register_engine(reg)
        self.set_credential(info.engine_id, info.credential)
        return info

    def unregister(self, engine_id: str) -> None:
        self.manager.unregister_engine(engine_id, caller=self._caller(engine_id))
        self._callers.pop(engine_id, None)

    def lookup(self, engine_id: str, chunks: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        return self.manager.lookup(engine_id, chunks, lease=lease, caller=self._caller(engine_id))

    def save(self, engine_id: str, chunks: Sequence[ChunkBlocks]) -> SaveResult:
        return self.manager.save(engine_id, chunks, caller=self._caller(engine_id))

    def restore(self, engine_id: str, chunks: Sequence[ChunkBlocks], *, lease_id: int = 0,
                layers: Sequence[int] | None = None) -> RestoreResult:
        return self.manager.restore(engine_id, chunks, lease_id=lease_id, layers=layers,
                                    caller=self._caller(engine_id))

    def release(self, lease_id: int) -> None:
        self.manager.release(lease_id)

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False) -> InvalidateResult:
        return self.manager.invalidate(keys=keys, chunks=chunks, namespace=namespace, engine_id=engine_id, all=all,
                                       caller=self._caller(engine_id))

    def stats(self) -> ManagerStats:
        return self.manager.stats()

    def close(self) -> None:
        """The embedded client does not own the Manager; closing it is the caller's business."""


def connect(target: "Manager | str", *, timeout: float | None = None, admin_token: str | None = None) -> Client:
    """Embedded client for a Manager object; remote client for a data-plane endpoint string, whose calls
    give up after ``timeout`` seconds without an answer (default: the remote client's own, 300 s);
    ``admin_token``: the Manager's, for invalidations beyond an engine's own namespace."""
    if isinstance(target, Manager):
        return EmbeddedClient(target)
    from .dataplane import RemoteClient

    if timeout is None:
        return RemoteClient(target, admin_token=admin_token)
    return RemoteClient(target, timeout=timeout, admin_token=admin_token)
