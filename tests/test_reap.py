"""Dead engines: a real engine process registers host pages through the data plane, is killed with SIGKILL,
and the Manager unregisters it by itself (its leases, reservations and pages-file mapping released, and the
pages file the engine could not remove removed), after the requests it still had in flight; engines
without a pid, or whose pid names another process, stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from orbitkv_fs.connectors.common import RestRegistrar, StagingPages
from orbitkv_fs.dataplane import DataPlaneServer
from orbitkv_fs.geometry import EngineRegistration, GeometryError, process_start_time
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import Manager, ManagerConfig, TierCounts, UnknownEngine
from metrics_text import prometheus_text

INTERVAL = 0.2

# The engine: staging pages (the connectors' registration, which carries its pid), a save, a lookup whose
# lease it never releases; then it reports and waits to be killed.
ENGINE = textwrap.dedent("""
    import sys, time
    from orbitkv_fs.connectors.common import StagingPages
    from orbitkv_fs.dataplane import RemoteClient
    from orbitkv_fs.keys import chunk_key
    from orbitkv_fs.manager import ChunkBlocks

    pages = StagingPages(num_layers=2, slots=16, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16",
                         directory=sys.argv[2])
    pages.key(0)[...] = 1
    c = RemoteClient(sys.argv[1], timeout=30)
    eng = c.register(pages.registration(model="m", engine_kind="test"))
    chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(4)]
    c.save(eng.engine_id, chunks)
    hit = c.lookup(eng.engine_id, [ch.key for ch in chunks])
    print(eng.engine_id, pages.pages.path, hit.count, hit.lease_id, eng.watched, flush=True)
    time.sleep(600)
""")


def mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def start_engine(endpoint: str, shm_dir: str = "/dev/shm") -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, endpoint, shm_dir], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if len(line) != 5:
        proc.kill()
        proc.wait()
        pytest.fail(f"engine process failed: {line}")
    return proc, line


@pytest.mark.parametrize("mode", ["pidfd", "kill0"])
def test_killed_engine_is_unregistered_and_its_resources_released(tmp_path, monkeypatch, mode):
    if mode == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd on this platform")
    if mode == "kill0":
        monkeypatch.delattr(os, "pidfd_open", raising=False)  # kill(pid, 0) + /proc/PID/stat start time
    # A directory of its own: the count of pages files reclaimed is this engine's alone.
    shm = tmp_path / "shm"
    shm.mkdir()
    with Manager(ManagerConfig(pool_size=4 << 20, device="cpu", engine_check_interval=INTERVAL,
                               shm_dir=str(shm))) as m:
        srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock", workers=2)
        proc, (engine_id, path, count, lease_id, watched) = start_engine(srv.endpoint, str(shm))
        try:
            assert (count, watched) == ("4", "True") and lease_id != "0"
            info = m.get_engine(engine_id)
            assert info.watched and info.registration.pid == proc.pid
            st = m.stats()
            assert (st.engines, st.leases_active, st.pinned_chunks) == (1, 1, 4)  # the lookup pinned its 4 chunks
            assert mapped(path)
            time.sleep(3 * INTERVAL)  # alive: the watcher leaves it alone
            assert m.stats().engines == 1
            proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            # Not waited for yet: the child stays a zombie, which must count as dead.
            # The counter moves once the reaping is complete (leases dropped, imports closed); the engine
            # leaves the table a moment before.
            while not m.stats().engines_reaped and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            gone = time.monotonic() - t0
            assert gone < INTERVAL + 1.0, f"reaped after {gone:.2f}s"
            with pytest.raises(UnknownEngine):
                m.get_engine(engine_id)
            st = m.stats()
            assert st.engines_reaped == 1
            assert (st.engines, st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                    st.workspace_bytes, st.inflight_requests) == (0, 0, 0, 0, 0, 0, 0)
            assert st.resident_objects["dram"] == 16  # cached objects belong to the namespace: they stay
            assert not mapped(path)
            # The engine died before it could remove its staging file (64 MiB of /dev/shm for a vLLM worker):
            # the Manager removed it after the reap.
            assert not os.path.exists(path) and st.pages_files_reclaimed == 1
            text = prometheus_text(m)  # last: skips without the extra
            assert b"orbitkv_engines_reaped_total 1.0" in text and b"orbitkv_pages_files_reclaimed_total 1.0" in text
        finally:
            proc.kill()
            proc.wait()
            srv.close()
            if os.path.exists(path):
                os.unlink(path)  # a failed run may have left it


def test_engine_without_pid_or_unidentified_process_is_never_reaped():
    # One pages file per engine: a piece of memory is registered by one engine only.
    pages, *more = [StagingPages(num_layers=2, slots=4, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
                    for _ in range(4)]
    tensors = iter(p.registration(model="m", engine_kind="test").tensors for p in more)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        reg = pages.registration(model="m", engine_kind="test")
        assert reg.pid == os.getpid() and reg.pid_start_time == process_start_time(os.getpid())
        fields = {f: getattr(reg, f) for f in reg.__struct_fields__}
        start = process_start_time(sleeper.pid)  # the child's /proc entry exists once Popen returns
        assert start is not None
        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu", engine_check_interval=INTERVAL)) as m:
            own = m.register_engine(reg)  # embedded: this process
            bare = m.register_engine(EngineRegistration(**{**fields, "pid": None, "pid_start_time": None,
                                                           "engine_id": "bare", "tensors": next(tensors)}))
            # The sleeper's pid, but another start time: as another PID namespace (or a reused pid) would
            # show it. Not watched, so its death below must not unregister it.
            other = m.register_engine(EngineRegistration(**{**fields, "pid": sleeper.pid,
                                                            "pid_start_time": start + 1, "engine_id": "other",
                                                            "tensors": next(tensors)}))
            mine = m.register_engine(EngineRegistration(**{**fields, "pid": sleeper.pid, "pid_start_time": start,
                                                           "engine_id": "sleeper", "tensors": next(tensors)}))
            assert (own.watched, bare.watched, other.watched, mine.watched) == (True, False, False, True)
            sleeper.kill()
            sleeper.wait()  # reaped by us: the pid is gone
            deadline = time.monotonic() + 10
            while m.stats().engines_reaped < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(3 * INTERVAL)
            assert sorted(e.engine_id for e in m.list_engines()) == sorted([own.engine_id, "bare", "other"])
            assert m.stats().engines_reaped == 1
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in (pages, *more):
            p.close()


def test_pid_fields_are_validated_and_carried_over_rest():
    pages = StagingPages(num_layers=1, slots=4, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    try:
        reg = pages.registration(model="m", engine_kind="test")
        fields = {f: getattr(reg, f) for f in reg.__struct_fields__}
        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
            for bad, field in (({"pid": 0}, "pid"), ({"pid": 1 << 22}, "pid"),
                               ({"pid": None, "pid_start_time": 5}, "pid_start_time"),
                               ({"pid_start_time": -1}, "pid_start_time")):
                with pytest.raises(GeometryError) as ei:
                    m.register_engine(EngineRegistration(**{**fields, **bad}))
                assert ei.value.field == field
            assert m.stats().engines == 0
        # The REST body the connectors send is accepted, and the pid reaches the Manager's registration.
        pytest.importorskip("fastapi")  # the rest needs the server extra
        from orbitkv_fs.server.models import RegisterRequest

        body = RegisterRequest.model_validate(RestRegistrar.body(reg))
        back = body.to_registration(lambda name, field: os.path.join("/dev/shm", name))
        assert (back.pid, back.pid_start_time) == (reg.pid, reg.pid_start_time)
        # GET /v1/engines shows the pid and whether the Manager watches it.
        from orbitkv_fs.server.app import _engine_out

        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
            info = m.register_engine(reg)
            out = _engine_out(info)
            assert (out.pid, out.watched) == (os.getpid(), True)
            m.unregister_engine(info.engine_id)  # frees its pages for the next registration
            out = _engine_out(m.register_engine(EngineRegistration(**{**fields, "pid": None, "pid_start_time": None,
                                                                        "tensors": reg.tensors})))
            assert (out.pid, out.watched) == (None, False)
    finally:
        pages.close()


class _StallingTier:
    """A lower tier that claims every object and holds the first read until ``go`` is set: a request in
    flight for as long as the test wants."""

    name = "stall"

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.go = threading.Event()

    def submit(self, key, segment, *, timeout=0.0):
        return False

    def read(self, key):
        return None

    def read_many(self, keys, sink=None):
        self.reading.set()
        assert self.go.wait(30)
        return [None] * len(keys)

    def contains(self, key):
        return True

    def invalidate(self, *, keys=None, namespace=None, all=False):
        return TierCounts()

    def flush(self, timeout=None):
        pass

    def stats(self):
        return {}

    def iter_objects(self, namespace=None):
        return iter(())

    def close(self):
        pass


def test_reaping_waits_for_the_dead_engines_requests_in_flight():
    pages = StagingPages(num_layers=1, slots=4, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tier = _StallingTier()
    try:
        reg = pages.registration(model="m", engine_kind="test")
        start = process_start_time(sleeper.pid)  # the child's /proc entry exists once Popen returns
        assert start is not None
        reg = EngineRegistration(**{**{f: getattr(reg, f) for f in reg.__struct_fields__},
                                    "pid": sleeper.pid, "pid_start_time": start})
        with Manager(ManagerConfig(pool_size=1 << 20, device="cpu", engine_check_interval=INTERVAL),
                     lower_tier=tier) as m:
            e = m.register_engine(reg).engine_id
            result: list = []
            t = threading.Thread(target=lambda: result.append(m.lookup(e, [chunk_key("x")])))
            t.start()
            assert tier.reading.wait(30)  # the lookup is in flight, inside the lower tier
            sleeper.kill()
            sleeper.wait()
            time.sleep(4 * INTERVAL)
            # Being unregistered: refused to new requests, not yet gone (its request still runs).
            with pytest.raises(UnknownEngine):
                m.lookup(e, [chunk_key("y")])
            assert m.stats().engines_reaped == 0 and m.stats().inflight_requests == 1
            tier.go.set()
            t.join(30)
            assert result and result[0].count == 0
            deadline = time.monotonic() + 10
            while m.stats().engines_reaped < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            st = m.stats()
            assert (st.engines_reaped, st.engines, st.inflight_requests, st.leases_active) == (1, 0, 0, 0)
    finally:
        tier.go.set()
        sleeper.kill()
        sleeper.wait()
        pages.close()
