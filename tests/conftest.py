"""Shared test configuration: ``gpu`` tests skip cleanly where no CUDA device is usable; the ``managers``
fixture starts Manager processes that share through peers (peer_manager_child.py); every test must leave
no OrbitKV-FS file behind in /dev/shm (``_no_shm_leftovers``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import time
import warnings
from pathlib import Path

import pytest

SHM = "/dev/shm"


def pytest_configure(config: pytest.Config) -> None:
    # setup.py installs gpu/, server/ and tools/ as orbitkv_fs's subpackages, and tests (and the processes they
    # start) import them by those names: an interpreter without the project installed would fail to collect a
    # score of modules, one traceback each, so say what is missing once instead.
    try:
        installed = importlib.util.find_spec("orbitkv_fs.gpu") is not None
    except ModuleNotFoundError:
        installed = False
    if not installed:
        pytest.exit("orbitkv_fs is not installed in this interpreter (setup.py maps gpu/, server/ and tools/ into "
                    "it): run `bash scripts/test.sh` (it installs it), or "
                    "`pip install -e '.[test,e2e,server,ssd,peer]'` first", returncode=4)


@functools.cache
def gpu_available() -> bool:
    try:
        from orbitkv_fs.gpu import unusable_reason
    except ImportError:  # a source tree run uninstalled has no orbitkv_fs.gpu (setup.py maps gpu/ there)
        return False
    return unusable_reason() is None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy with a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def managers():
    """``make(**cfg)`` starts a Manager process (:class:`peer_manager_child.Mgr`); all are closed after."""
    from json_child import spawner
    from peer_manager_child import Mgr

    with spawner(Mgr) as make:
        yield make


def _orbitkv_shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith("orbitkv-")}
    except OSError:  # no /dev/shm here: arenas and pages live elsewhere
        return set()


def _in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` some live process maps or holds open (a running Manager's arena, an engine's
    pages): not left behind, only not finished yet."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            used.update(p for p in paths if p in maps)
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                target = os.readlink(os.path.join(fd_dir, fd))
                if target in paths:
                    used.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 16 MiB tmpfs (a container's small /dev/shm), where one can be mounted (as root)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(autouse=True)
def _no_shm_leftovers():
    """A file named orbitkv-* that appeared in /dev/shm during a test and that no process uses once the
    test ended was left behind by it (tmpfs memory, held until someone removes it). Files in use (a
    module's Manager, another run's) are not counted. In CI (``CI`` set, one run alone on its machine) or
    with ``ORBITKV_SHM_CHECK=1`` the test fails at teardown, naming the files; elsewhere it is a warning,
    since on a machine shared with other runs a file another run leaked may appear during this test."""
    before = _orbitkv_shm_files()
    yield
    new = _orbitkv_shm_files() - before
    if not new:
        return
    time.sleep(0.2)  # a process that is ending may still be removing its files
    left = {os.path.join(SHM, n) for n in _orbitkv_shm_files() & new}
    left -= _in_use(left)
    if left:
        size = sum(os.path.getsize(p) for p in left if os.path.exists(p))
        what = f"the test left {sorted(left)} in {SHM} ({size} bytes); remove what it (or a process it killed) made"
        if os.environ.get("CI") or os.environ.get("ORBITKV_SHM_CHECK") == "1":
            pytest.fail(what, pytrace=False)
        warnings.warn(what, stacklevel=1)
