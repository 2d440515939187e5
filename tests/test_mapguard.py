"""An engine's pages file shrunk under the Manager's mapping. The file is the registering user's: it may truncate
it whenever it likes, and the Manager's next copy from or into the pages past the new end raised SIGBUS, which
ended the Manager, and every engine's cache with it (one ``ftruncate`` from any local user that may register).
:mod:`orbitkv_fs.mapguard` survives such faults inside guarded mappings and counts them; the Manager refuses to
keep anything read from pages that shrank (:class:`PagesLost`), and refuses the engine's later calls. A fault
anywhere else still ends the process as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request

import numpy as np
import pytest

from orbitkv_fs import mapguard
from orbitkv_fs.pages import HostPages, PagesError
from manager_process import ManagerProcess, run_python, sample_engine_round_trip


def _in_child(program: str, *args: str) -> str:
    """Run ``program`` in a fresh interpreter: should the guard fail, SIGBUS ends the child, not the test run."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(program), *args], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, (f"child ended with {p.returncode}", p.stdout, p.stderr)
    return p.stdout


SHRUNK = """
    import mmap, os, sys
    import numpy as np
    from orbitkv_fs import mapguard
    fd = os.open(os.path.join(sys.argv[1], "pages"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, 1 << 20)
    mm = mmap.mmap(fd, 1 << 20)
    a = np.frombuffer(mm, dtype=np.uint8)
    a[:] = 7
    g = mapguard.guard(a.ctypes.data, a.nbytes)
    print(g.faults)
    os.ftruncate(fd, 4096)
    print(int(a.sum()), g.faults)  # the first page is the file's; the rest read as zeros
    a[8192:16384] = 1  # writes past the end land in the zero pages, not in the file
    print(os.fstat(fd).st_size, g.faults)
    g.release()
    print(g.faults)
"""


def test_a_guarded_mapping_survives_its_file_shrinking_and_counts_the_faults(tmp_path):
    assert _in_child(SHRUNK, str(tmp_path)).split("\n")[:4] == ["0", f"{4096 * 7} 255", "4096 255", "0"]


CHILD = textwrap.dedent("""
    import faulthandler, mmap, os, sys
    import numpy as np
    from orbitkv_fs import mapguard
    if sys.argv[2] == "faulthandler":
        faulthandler.enable()
    def mapped(name):
        fd = os.open(os.path.join(sys.argv[1], name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, 1 << 16)
        mm = mmap.mmap(fd, 1 << 16)
        return fd, mm, np.frombuffer(mm, np.uint8)
    fd1, mm1, guarded = mapped("guarded")
    fd2, mm2, other = mapped("other")
    g = mapguard.guard(guarded.ctypes.data, guarded.nbytes)
    if sys.argv[3] == "released":
        g.release()
        os.ftruncate(fd1, 0)
        print(int(guarded.sum()), flush=True)
    else:
        os.ftruncate(fd1, 0)
        print("guarded", int(guarded.sum()), g.faults, flush=True)
        os.ftruncate(fd2, 0)
        print(int(other.sum()), flush=True)
    print("survived", flush=True)
""")


@pytest.mark.parametrize("handler", ["faulthandler", "default"])
@pytest.mark.parametrize("where", ["elsewhere", "released"])
def test_a_fault_outside_every_guarded_range_still_ends_the_process(tmp_path, handler, where):
    """A fault in a mapping nobody guards (or whose guard was released) goes to the action that was there
    before: faulthandler's report, then death by SIGBUS; or straight death."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), handler, where], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr)
    assert "survived" not in p.stdout
    if where == "elsewhere":
        assert p.stdout.splitlines()[0] == "guarded 0 16"
    if handler == "faulthandler":
        assert "Bus error" in p.stderr


def test_a_release_that_runs_inside_guard_does_not_deadlock(monkeypatch):
    """A guard whose mapping still had views when it was unmapped is released by a ``weakref.finalize``, which the
    garbage collector may run at any allocation: also one inside :func:`mapguard.guard`'s locked section (its
    ``sigaction`` buffers). That deadlocked a CI run (the test below, waiting on its own lock); the release must
    go through."""
    import threading

    old = mapguard.guard(1 << 41, 4096)
    install = mapguard._install

    def install_then_finalize() -> None:
        old.release()  # what a finalizer run by a collection here does
        install()

    monkeypatch.setattr(mapguard, "_install", install_then_finalize)
    got: list = []
    th = threading.Thread(target=lambda: got.append(mapguard.guard(1 << 42, 4096)), daemon=True)
    th.start()
    th.join(30)
    assert not th.is_alive(), "guard() deadlocked on a release run inside it"
    assert old.slot == -1 and got[0].slot >= 0
    got[0].release()


def test_guards_are_bounded_and_their_slots_come_back(tmp_path):
    """Past the bound a pages file is refused (a registration names it), not mapped unguarded."""
    pages = HostPages.create([("t", [4, 16], "bfloat16", "kv")], path=str(tmp_path / "pages"))
    held = [mapguard.guard(4096 * (i + 1), 4096) for i in range(mapguard.MAX_GUARDS - _live_guards())]
    try:
        with pytest.raises(OverflowError):
            mapguard.guard(1 << 40, 4096)
        with pytest.raises(PagesError, match="guarded already"):
            HostPages.open(pages.path, guarded=True)
        held.pop().release()
        mapguard.guard(1 << 40, 4096).release()
    finally:
        for g in held:
            g.release()
        pages.close()


def _live_guards() -> int:
    return int(np.count_nonzero(mapguard._table[:, 0]))


SAVE_FROM_SHRUNK = """
    import os, sys
    import numpy as np
    from orbitkv_fs import mapguard
    from orbitkv_fs.connectors.common import StagingPages
    from orbitkv_fs.keys import chunk_key
    from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig, PagesLost, UnknownEngine
    live = lambda: int(np.count_nonzero(mapguard._table[:, 0]))
    with Manager(ManagerConfig(pool_size=8 << 20, device="cpu", engine_check_interval=0)) as m:
        pages = StagingPages(num_layers=2, slots=64, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16",
                             directory=sys.argv[2])
        pages.key(0)[...] = 1
        base = live()  # the arena's own, not reserved here
        e = m.register_engine(pages.registration(model="m", engine_kind="test", codec=sys.argv[1]))
        print("guards", live() - base)
        first = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(2)]
        m.save(e.engine_id, first)
        before = m.stats()
        os.truncate(pages.pages.path, 4096)  # the header page only
        try:
            m.save(e.engine_id, [ChunkBlocks(chunk_key(f"d{i}"), [32 + i]) for i in range(4)])
        except PagesLost as err:
            print("save:", err)
        st = m.stats()
        print("kept", st.resident_objects == before.resident_objects, st.reserved_bytes, st.pages_lost)
        for name, call in (("lookup", lambda: m.lookup(e.engine_id, [first[0].key])),
                           ("save", lambda: m.save(e.engine_id, first)),
                           ("restore", lambda: m.restore(e.engine_id, first))):
            try:
                call()
            except PagesLost:
                print("refused", name)
        m.unregister_engine(e.engine_id)
        try:
            m.lookup(e.engine_id, [first[0].key])
        except UnknownEngine:
            print("unregistered; guards", live() - base)
        pages.close()
"""


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_a_save_from_pages_that_shrank_keeps_nothing_and_the_engine_is_refused_after(codec, tmp_path):
    """Both host save paths (exact segments copied into the arena, and a codec batch gathered and encoded):
    the save raises :class:`PagesLost`, nothing of it is published or left reserved, the engine's later calls
    are refused with the same reason, and it can be unregistered (its guard released)."""
    out = _in_child(SAVE_FROM_SHRUNK, codec, str(tmp_path)).splitlines()
    assert out[0] == "guards 1" and out[1].startswith("save: engine") and "shrank" in out[1], out
    assert out[2:] == ["kept True 0 1", "refused lookup", "refused save", "refused restore", "unregistered; guards 0"]


ATTACKER = """
import os, sys
from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration, PagesLost
from orbitkv_fs.pages import HostPages, PageTensor
dp, shm, when = sys.argv[1], sys.argv[2], sys.argv[3]
tensors = [PageTensor(f"L{l}.{r}", 0, [64, 16, 2, 64], [], "bfloat16", r, l, "separate")
           for l in range(2) for r in ("key", "value")]
path = f"{shm}/orbitkv-pages-{when}"
pages = HostPages.create(tensors, path=path)
reg = EngineRegistration(model="attacker", num_layers=2, layer_start=0, layer_end=2, block_size=16, num_heads=2,
                         head_dim=64, dtype="bfloat16", tensors=[pages.descriptor(t) for t in pages.tensors],
                         engine_kind="sample", engine_id=when)
c = connect(dp, timeout=30)
c.register(reg)
chunks = [ChunkBlocks(chunk_key(f"a{i}"), [i]) for i in range(8)]
c.save(when, chunks)
os.truncate(path, 4096)
try:
    c.restore(when, chunks) if when == "restore" else c.save(when, [ChunkBlocks(chunk_key("b"), [40])])
    print("no error")
except PagesLost as e:
    print("PagesLost:", e)
c.unregister(when)
print("unregistered")
"""


def test_a_process_that_truncates_its_pages_under_the_manager_does_not_end_it(tmp_path):
    """A second OS process, no token: registers over its own pages file, saves, truncates the file, then saves
    (the Manager reads past the end) or restores (it writes past it). Before the guard the Manager died of
    SIGBUS at that call. Now the call raises :class:`PagesLost` in the client, the Manager answers, counts
    both engines in ``orbitkv_engines_pages_lost_total``, and another engine saves and restores."""
    mgr = ManagerProcess(shm_dir=str(tmp_path), pool="64mb")
    try:
        for when in ("save", "restore"):
            out = run_python(ATTACKER, mgr.endpoint, str(tmp_path), when)
            assert "PagesLost:" in out and "shrank" in out and "unregistered" in out, out
            assert mgr.proc.poll() is None, mgr.log
        assert mgr.metric("orbitkv_engines_pages_lost_total") == 2
        sample_engine_round_trip(mgr.endpoint, str(tmp_path))
        with urllib.request.urlopen(mgr.http + "/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        assert mgr.stop() == 0, mgr.log


ARENA_UNBACKED = """
    import os, sys
    import numpy as np
    from orbitkv_fs.connectors.common import StagingPages
    from orbitkv_fs.keys import chunk_key
    from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
    shm, how = sys.argv[1], sys.argv[2]
    with Manager(ManagerConfig(pool_size=16 << 20, device="cpu", engine_check_interval=0, shm_dir=shm,
                               reserve_pool=False)) as m:
        pages = StagingPages(num_layers=2, slots=64, block_size=16, num_heads=2, head_dim=64, dtype="bfloat16",
                             directory=shm)
        rng = np.random.default_rng(0)
        for layer in range(2):
            pages.key(layer)[...] = rng.standard_normal(pages.key(layer).shape).astype(pages.key(layer).dtype)
            pages.value(layer)[...] = rng.standard_normal(pages.value(layer).shape).astype(pages.value(layer).dtype)
        e = m.register_engine(pages.registration(model="m", engine_kind="test"))
        chunks = [ChunkBlocks(chunk_key(f"c{i}"), [i]) for i in range(32)]
        m.save(e.engine_id, chunks[:1])
        if how == "fill":  # another process's file takes what the directory has left
            with open(os.path.join(shm, "filler"), "wb") as f:
                try:
                    while True:
                        f.write(b"x" * (1 << 20))
                except OSError:
                    pass
        else:  # the arena's backing gone under its mapping, as a full directory leaves it for new pages
            os.truncate(m.dram.arena.path, 0)
        kept = [pages.key(layer)[:32].copy() for layer in range(2)]
        m.save(e.engine_id, chunks)
        for layer in range(2):
            pages.key(layer)[...] = 0
        r = m.restore(e.engine_id, chunks[1:])
        same = all(np.array_equal(pages.key(layer)[1:32], kept[layer][1:]) for layer in range(2))
        # the first chunk's pages were written before: kept by a full directory, gone with a truncated file
        # (read as zeros, which fail their CRC: a miss, never served)
        first = m.restore(e.engine_id, chunks[:1]).restored[0]
        print(all(r.restored), same, m.stats().pool_private_bytes > 0, first)
        m.unregister_engine(e.engine_id)
        pages.close()
"""


def test_an_arena_whose_directory_cannot_back_it_takes_private_pages_instead_of_dying(tmp_path):
    """``reserve_pool`` off: the pool's pages come with their first writes, and a directory that has nothing
    left then (here: the arena file truncated under its mapping) raised SIGBUS in the Manager. Those pages are
    private memory of the Manager now; saves and restores go on byte for byte, and the stats say how much."""
    assert _in_child(ARENA_UNBACKED, str(tmp_path), "truncate").split() == ["True", "True", "True", "False"]


def test_a_full_tmpfs_under_an_unreserved_arena(tmp_path):
    """The same with a real full tmpfs: another process's file takes what a 32 MiB tmpfs has left after the
    Manager started with a 16 MiB pool it did not reserve (needs root, for the mount)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (and a mount namespace that allows it)")
    try:
        assert _in_child(ARENA_UNBACKED, str(mnt), "fill").split() == ["True", "True", "True", "True"]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
