"""Client API in both modes: a real ``orbitkv-cache-manager`` process over the data plane, two engine
processes saving and restoring at once, typed errors across the socket, clean shutdown on SIGTERM."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
import zmq

from orbitkv_fs.client import EmbeddedClient, connect
from orbitkv_fs.dataplane import DataPlaneServer, RemoteClient
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.geometry import EngineRegistration, GeometryError
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig, RequestError, UnknownEngine
from orbitkv_fs.pages import host_engine_pages

L, B, T, H, D = 4, 32, 16, 2, 64


def new_engine(seed: int):
    pages, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D)
    rng = np.random.default_rng(seed)
    for n in pages.tensors:
        a = pages.array(n)
        a[...] = rng.standard_normal(a.shape).astype(ml_dtypes.bfloat16)
    reg = EngineRegistration(model="m", num_layers=L, layer_start=0, layer_end=L, block_size=T, num_heads=H,
                             head_dim=D, dtype="bfloat16", tensors=descs)
    return pages, reg


def exercise(client, seed: int, rounds: int = 3) -> None:
    """Register, then save / drop the pages / lookup / restore, checking every byte; unregister."""
    pages, reg = new_engine(seed)
    try:
        orig = {n: pages.array(n).copy() for n in pages.tensors}
        eng = client.register(reg)
        for rnd in range(rounds):
            chunks = [ChunkBlocks(chunk_key(f"{seed}-{rnd}-{i}"), [2 * i, 2 * i + 1]) for i in range(B // 2)]
            r = client.save(eng.engine_id, chunks)
            assert r.segments + 0 == r.segments  # typed result
            lk = client.lookup(eng.engine_id, [c.key for c in chunks])
            for n in pages.tensors:
                pages.array(n)[...] = 0
            res = client.restore(eng.engine_id, chunks[: lk.count], lease_id=lk.lease_id)
            assert all(res.restored) and len(res.restored) == lk.count
            done = [b for c in chunks[: lk.count] for b in c.blocks]
            for n in pages.tensors:
                assert np.array_equal(pages.array(n)[done].view(np.uint16), orig[n][done].view(np.uint16))
                pages.array(n)[...] = orig[n]
        client.unregister(eng.engine_id)
    finally:
        pages.close()


def _child(endpoint: str, seed: int, q) -> None:
    try:
        c = RemoteClient(endpoint, timeout=60)
        exercise(c, seed, rounds=4)
        c.close()
        q.put(None)
    except BaseException as e:  # reported to the parent
        q.put(repr(e))


@pytest.fixture
def server(tmp_path):
    endpoint = f"ipc://{tmp_path}/dp.sock"
    proc = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "3mb", "--device", "cpu",
                             "--data-plane", endpoint, "--http-addr", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    c = RemoteClient(endpoint, timeout=1)
    deadline = time.monotonic() + 60
    while True:
        try:
            c.ping()
            break
        except OrbitKVError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(proc.communicate()[0])
    c.close()
    yield endpoint, proc
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: the manager removes its arena (SIGKILL would leave it in /dev/shm)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_two_engine_processes_against_one_manager_process(server):
    endpoint, proc = server
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    kids = [ctx.Process(target=_child, args=(endpoint, s, q)) for s in (1, 2)]
    for k in kids:
        k.start()
    results = [q.get(timeout=240) for _ in kids]
    for k in kids:
        k.join(30)
    assert results == [None, None]
    c = RemoteClient(endpoint)
    st = c.stats()
    assert st.evictions > 0  # 3 MiB pool, 2 x 4 rounds x 512 KiB saved
    assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
            st.workspace_bytes, st.inflight_requests) == (0, 0, 0, 0, 0, 0)
    assert st.engines == 0 and st.restore_requests == 8
    c.close()
    # SIGTERM: a clean exit that removes the arena file.
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    # the ready line's arena (a warning before it may name the stale arena files it reclaimed)
    ready = next(line for line in out.splitlines() if "ready: data plane" in line)
    path = ready.split(", arena ")[1].split(" ")[0]
    assert path.startswith("/dev/shm/orbitkv-arena-") and not os.path.exists(path)


def test_errors_are_the_same_classes_remote_and_embedded(server):
    endpoint, _ = server
    pages, reg = new_engine(3)
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
        for client in (EmbeddedClient(m), RemoteClient(endpoint)):
            with pytest.raises(UnknownEngine):
                client.lookup("nope", [b"k" * 16])
            with pytest.raises(GeometryError) as ei:
                client.register(EngineRegistration(**{**_fields(reg), "head_dim": 128}))
            assert ei.value.field == "tensors[0].shape[3]"
            eng = client.register(reg)
            with pytest.raises(RequestError, match="unknown block"):
                client.save(eng.engine_id, [ChunkBlocks(b"k" * 16, [B])])
            with pytest.raises(RequestError):
                client.invalidate()
            r = client.invalidate(engine_id=eng.engine_id)
            assert r.dram.objects == 0
            client.unregister(eng.engine_id)
            client.close()
    pages.close()


def _fields(reg: EngineRegistration) -> dict:
    return {f: getattr(reg, f) for f in reg.__struct_fields__}


def test_malformed_requests_get_errors_not_crashes(tmp_path):
    with Manager(ManagerConfig(pool_size=1 << 20, device="cpu")) as m:
        srv = DataPlaneServer(m, f"ipc://{tmp_path}/x.sock", workers=1)
        try:
            ctx = zmq.Context()
            s = ctx.socket(zmq.REQ)
            s.connect(srv.endpoint)
            for junk in (b"", b"\xc1", b"\x92\xa6lookup\x01", os.urandom(64)):
                s.send(junk)
                assert s.recv()[:1] == b"\x01"
            s.close(0)
            ctx.term()
            c = connect(srv.endpoint)
            c.ping()
            assert c.stats().engines == 0
            c.close()
        finally:
            srv.close()
        with pytest.raises(ValueError, match="not loopback"):
            DataPlaneServer(m, "tcp://0.0.0.0:0")


def test_embedded_mode_same_flow():
    with Manager(ManagerConfig(pool_size=3 << 20, device="cpu")) as m:
        c = connect(m)
        exercise(c, 5)
        st = c.stats()
        assert (st.reserved_bytes, st.leases_active, st.pinned_chunks, st.leased_bytes,
                st.workspace_bytes) == (0, 0, 0, 0, 0)


def test_remote_client_times_out_without_server(tmp_path):
    c = RemoteClient(f"ipc://{tmp_path}/nobody.sock", timeout=0.2)
    t = time.monotonic()
    with pytest.raises(OrbitKVError, match="no answer"):
        c.stats()
    assert time.monotonic() - t < 5
    c.close()
