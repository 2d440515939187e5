"""Engines cannot act on each other (docs/security.md): a real ``orbitkv-cache-manager`` process, a victim
engine registered through the client, and a second process that attacks it over the data plane -- restore
into its pages, look up, save, release and unregister in its name, invalidate its namespace or everything,
register its pages under their name, a hard link or a symlink, or a pages file outside ``--shm-dir``.
Every attack gets its typed error and the victim's pages, registration and cached objects are untouched,
while the attacker's own engine (same model, so the same namespace: shared on purpose) works. Run as
root, an attacker of another OS user is refused the pages of the Manager's user even when no engine holds
them, and ``lookup_by_user`` lets the registering user, not another, look an engine up without its
credential."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np
import pytest

from manager_process import ManagerProcess, run_python
from orbitkv_fs.dataplane import RemoteClient
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks
from orbitkv_fs.pages import host_engine_pages

L, B, T, H, D = 2, 16, 16, 2, 64


def _engine(shm: str, seed: int, **kw):
    pages, descs = host_engine_pages(num_layers=L, num_blocks=B, block_size=T, num_heads=H, head_dim=D,
                                     directory=shm)
    rng = np.random.default_rng(seed)
    for n in pages.tensors:
        a = pages.array(n)
        a[...] = rng.standard_normal(a.shape).astype(ml_dtypes.bfloat16)
    reg = EngineRegistration(model="m", num_layers=L, layer_start=0, layer_end=L, block_size=T, num_heads=H,
                             head_dim=D, dtype="bfloat16", tensors=descs, **kw)
    return pages, reg


def _snapshot(pages) -> dict[str, bytes]:
    return {n: pages.array(n).tobytes() for n in pages.tensors}


# The attacker: another process, with a client of its own, that knows the victim's engine id, namespace,
# chunk keys, lease id and pages layout (all predictable or listed by GET /v1/engines) but not its credential.
ATTACKER = r"""
import json, os, sys
import msgspec
from orbitkv_fs import dataplane as dp
from orbitkv_fs.geometry import EngineRegistration, HostPagesHandle
from orbitkv_fs.keys import ObjectKey
from orbitkv_fs.manager import ChunkBlocks
from orbitkv_fs.pages import host_engine_pages

cfg = json.loads(sys.argv[1])
c = dp.RemoteClient(cfg["endpoint"], timeout=30)
victim, ns = cfg["victim"], bytes.fromhex(cfg["namespace"])
keys = [bytes.fromhex(k) for k in cfg["keys"]]
reg = msgspec.json.decode(cfg["registration"].encode(), type=EngineRegistration)
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"

def pages_at(path):
    return msgspec.structs.replace(reg, engine_id=None, tensors=[
        msgspec.structs.replace(t, handle=HostPagesHandle(path, t.handle.offset)) for t in reg.tensors])

attempt("restore", lambda: c.restore(victim, [ChunkBlocks(keys[0], [5, 6])]))
attempt("lookup", lambda: c.lookup(victim, keys, lease=False))
attempt("lookup_lease", lambda: c.lookup(victim, keys))
attempt("save", lambda: c.save(victim, [ChunkBlocks(b"x" * 16, [1, 2])]))
attempt("release", lambda: c._call(dp.Release(cfg["lease"], victim, ""), None))
attempt("invalidate_engine", lambda: c.invalidate(engine_id=victim))
attempt("invalidate_namespace", lambda: c.invalidate(namespace=ns))
attempt("invalidate_keys", lambda: c.invalidate(keys=[ObjectKey(ns, keys[0], 0, 1)]))
attempt("invalidate_all", lambda: c.invalidate(all=True))
attempt("invalidate_admin_guess", lambda: c._call(dp.Invalidate(None, None, None, None, True, "", "x" * 32),
                                                 dp.InvalidateResult))
attempt("register_same_pages", lambda: c.register(pages_at(cfg["victim_pages"])))
link = os.path.join(cfg["shm"], "attacker-hardlink")
os.link(cfg["victim_pages"], link)
attempt("register_hard_link", lambda: c.register(pages_at(link)))
os.unlink(link)
outside, _ = host_engine_pages(num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_dim=64,
                               directory=cfg["outside"])
attempt("register_outside", lambda: c.register(pages_at(outside.path)))
sym = os.path.join(cfg["shm"], "attacker-symlink")
os.symlink(outside.path, sym)
attempt("register_symlink_out", lambda: c.register(pages_at(sym)))
os.unlink(sym)
outside.close()
attempt("unregister", lambda: c.unregister(victim))
# Its own engine: same model and geometry, so the victim's namespace (shared by design), its own pages.
own, descs = host_engine_pages(num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_dim=64,
                               directory=cfg["shm"])
info = c.register(msgspec.structs.replace(reg, engine_id=None, tensors=descs))
out["own_namespace"] = info.namespace
out["own_lookup"] = c.lookup(info.engine_id, keys, lease=False).count
c.unregister(info.engine_id)
own.close()
print(json.dumps(out))
"""


@pytest.fixture
def shm():
    # Like /dev/shm: sticky and world-writable, reachable by every user (pytest's tmp_path is not).
    d = tempfile.mkdtemp(prefix="orbitkv-trust-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_second_process_cannot_act_on_an_engine(tmp_path, shm):
    mgr = ManagerProcess(shm_dir=shm, endpoint=f"ipc://{tmp_path}/dp.sock")
    pages, reg = _engine(shm, 1)
    try:
        c = RemoteClient(mgr.endpoint, timeout=30)
        eng = c.register(reg)
        chunks = [ChunkBlocks(chunk_key(f"v{i}"), [2 * i, 2 * i + 1]) for i in range(4)]
        c.save(eng.engine_id, chunks)
        lease = c.lookup(eng.engine_id, [ch.key for ch in chunks]).lease_id
        assert lease
        before = _snapshot(pages)
        outside = tmp_path / "outside"
        outside.mkdir()
        cfg = {"endpoint": mgr.endpoint, "victim": eng.engine_id, "namespace": eng.namespace,
               "keys": [ch.key.hex() for ch in chunks], "lease": lease, "victim_pages": pages.path, "shm": shm,
               "outside": str(outside), "registration": json.dumps(_wire(reg))}
        got = json.loads(run_python(ATTACKER, json.dumps(cfg)))
        expect = {"restore": "Unauthenticated", "lookup": "Unauthenticated", "lookup_lease": "Unauthenticated",
                  "save": "Unauthenticated", "release": "Unauthenticated",
                  "invalidate_engine": "Unauthenticated", "invalidate_namespace": "AdminRequired",
                  "invalidate_keys": "AdminRequired", "invalidate_all": "AdminRequired",
                  "invalidate_admin_guess": "AdminRequired",
                  "register_same_pages": "HandleInUse", "register_hard_link": "HandleInUse",
                  "register_outside": "GeometryError", "register_symlink_out": "GeometryError",
                  "unregister": "Unauthenticated"}
        assert {k: got[k].split(":")[0] for k in expect} == expect, got
        assert "not a file directly inside" in got["register_outside"]
        assert "not a file directly inside" in got["register_symlink_out"]
        assert (got["own_namespace"], got["own_lookup"]) == (eng.namespace, 4)  # shared namespace, by design
        # The victim: pages untouched, still registered, its lease and its objects still there.
        assert _snapshot(pages) == before
        for n in pages.tensors:
            pages.array(n)[:8] = 0  # the saved blocks, restored below under the victim's lease
        assert c.restore(eng.engine_id, chunks, lease_id=lease).restored == [True] * 4
        assert {n: pages.array(n).tobytes() for n in pages.tensors} == before
        assert c.lookup(eng.engine_id, [ch.key for ch in chunks], lease=False).count == 4
        assert mgr.metric("orbitkv_dataplane_auth_failures_total") >= 11
        c.unregister(eng.engine_id)
        c.close()
    finally:
        pages.close()
        assert mgr.stop() == 0, mgr.log


def _wire(reg: EngineRegistration) -> object:
    import msgspec

    return msgspec.json.decode(msgspec.json.encode(reg))


# An attacker of another OS user (nobody): imports first, then drops root, then acts over loopback TCP.
OTHER_USER = r"""
import json, os, sys
import msgspec
from orbitkv_fs import dataplane as dp
from orbitkv_fs.geometry import EngineRegistration, HostPagesHandle
from orbitkv_fs.pages import host_engine_pages

cfg = json.loads(sys.argv[1])
reg = msgspec.json.decode(cfg["registration"].encode(), type=EngineRegistration)
os.setgid(65534)
os.setuid(65534)
c = dp.RemoteClient(cfg["endpoint"], timeout=30)
out = {}
try:
    c.register(msgspec.structs.replace(reg, engine_id=None))  # the Manager user's pages, held by nobody
    out["register_root_pages"] = "ok"
except Exception as e:
    out["register_root_pages"] = f"{type(e).__name__}: {e}"
try:
    c.lookup(cfg["victim"], [bytes(16)], lease=False)
    out["lookup_by_other_user"] = "ok"
except Exception as e:
    out["lookup_by_other_user"] = f"{type(e).__name__}: {e}"
own, descs = host_engine_pages(num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_dim=64,
                               directory=cfg["shm"])
info = c.register(msgspec.structs.replace(reg, engine_id=None, tensors=descs))
out["own"] = c.lookup(info.engine_id, [bytes(16)], lease=False).count
c.unregister(info.engine_id)
own.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_register_the_managers_users_pages_nor_look_up_by_user(tmp_path, shm):
    mgr = ManagerProcess(shm_dir=shm)  # loopback TCP: the peer's user comes from /proc/net/tcp
    free_pages, free_reg = _engine(shm, 2)  # root's pages, registered by nobody yet
    pages, reg = _engine(shm, 3, lookup_by_user=True)
    try:
        c = RemoteClient(mgr.endpoint, timeout=30)
        eng = c.register(reg)
        cfg = {"endpoint": mgr.endpoint, "victim": eng.engine_id, "shm": shm,
               "registration": json.dumps(_wire(free_reg))}
        got = json.loads(run_python(OTHER_USER, json.dumps(cfg)))
        assert got["register_root_pages"].startswith("GeometryError") and "belongs to user 0" in \
            got["register_root_pages"], got
        assert got["lookup_by_other_user"].startswith("Unauthenticated"), got
        assert got["own"] == 0  # nobody's own pages, registered by nobody: fine
        # The registering user's other processes may look it up without the credential (vLLM's scheduler),
        # and only look it up.
        other = RemoteClient(mgr.endpoint, timeout=30)
        assert other.lookup(eng.engine_id, [bytes(16)], lease=False).count == 0
        with pytest.raises(Exception, match="credential"):
            other.lookup(eng.engine_id, [bytes(16)])  # a lease pins memory: credential only
        with pytest.raises(Exception, match="credential"):
            other.save(eng.engine_id, [ChunkBlocks(bytes(16), [0])])
        other.close()
        c.unregister(eng.engine_id)
        c.close()
    finally:
        pages.close()
        free_pages.close()
        assert mgr.stop() == 0, mgr.log


def test_claims_are_byte_ranges_of_one_memory():
    """A CUDA IPC handle names a whole cudaMalloc block: two engines' tensors in one block (PyTorch's
    caching allocator does that within a process) are different memory; overlapping extents are not."""
    from orbitkv_fs.access import HandleClaims, HandleInUse

    claims = HandleClaims()
    block = ("cuda_ipc", b"\x01" * 64, 0)
    claims.claim("a", [("tensors[0].handle", block, 0, 4096), ("tensors[1].handle", block, 4096, 8192)])
    claims.claim("b", [("tensors[0].handle", block, 8192, 12288)])
    with pytest.raises(HandleInUse, match="'a'"):
        claims.claim("c", [("tensors[0].handle", block, 12288, 16384), ("tensors[1].handle", block, 8191, 8193)])
    claims.claim("c", [("tensors[0].handle", block, 12288, 16384)])  # the refused claim recorded nothing
    pages = ("file", 1, 2)
    claims.claim("a", [("tensors[0].handle", pages, 0, 1 << 64)])
    with pytest.raises(HandleInUse):
        claims.claim("d", [("tensors[0].handle", pages, 0, 1 << 64)])
    claims.release("a")
    claims.claim("d", [("tensors[0].handle", pages, 0, 1 << 64), ("tensors[1].handle", block, 0, 8192)])


LOOKUP_WITHOUT_DESCRIPTORS = """
import json, os, resource, socket
from orbitkv_fs.access import Caller, socket_uid
srv = socket.create_server(("127.0.0.1", 0))
peer = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
known = socket_uid(conn)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
caller = Caller(uid_of=lambda: socket_uid(conn))
print(json.dumps({"known": known == os.getuid(), "uid": caller.uid(), "because": caller.unknown_because}))
"""


def test_a_user_lookup_that_fails_for_want_of_descriptors_says_so(tmp_path, shm):
    """A loopback TCP caller's OS user comes from /proc/net/tcp. A Manager out of descriptors cannot open it:
    the refusal must name that, not call the caller a remote peer (as it did while a flood of HTTP connections
    held every descriptor: docs/results/2026-12-05-http-flood)."""
    from orbitkv_fs.access import Caller
    from orbitkv_fs.geometry import GeometryError
    from orbitkv_fs.manager import Manager, ManagerConfig

    out = json.loads(run_python(LOOKUP_WITHOUT_DESCRIPTORS))
    assert out["known"] is True and out["uid"] is None
    assert "Too many open files" in out["because"], out
    pages, reg = _engine(shm, 1)
    m = Manager(ManagerConfig(pool_size=4 << 20, shm_dir=shm, device="cpu"))
    try:
        def no_descriptors() -> int:
            raise OSError(24, "Too many open files")

        with pytest.raises(GeometryError, match="could not look it up: .*Too many open files"):
            m.register_engine(reg, caller=Caller(uid_of=no_descriptors))
    finally:
        m.close()
        pages.close()
