"""Provenance of a benchmark result: which code produced it.

* :func:`code_identity` -- the git commit of the checkout (when there is one), whether tracked files differ
  from it, and :func:`source_digest` of the installed package. The digest identifies the code that ran even
  where the checkout's history is stale or absent (a copy of a working tree on a lent GPU machine reports
  the commit its ``.git`` was copied at, not the one its files came from).
* :func:`source_digest` -- SHA-256 over the package's Python and CUDA sources, each named by its path inside
  the package, so an editable checkout and an installed wheel of the same code give the same digest.

Invariant: reading provenance never fails a benchmark; what cannot be read is reported as empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
from typing import Iterable

#: The package and its separately mapped subpackages (setup.py maps gpu/, server/ and tools/ into it).
PACKAGES = ("orbitkv_fs", "orbitkv_fs.gpu", "orbitkv_fs.server", "orbitkv_fs.tools")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


def package_roots(packages: Iterable[str] = PACKAGES) -> list[tuple[str, str]]:
    """(package name, directory) of each package that is installed, without importing it, and without
    directories that lie inside another one already listed (a wheel keeps subpackages inside the package)."""
    found: list[tuple[str, str]] = []
    for name in packages:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                found.append((name, os.path.realpath(list(spec.submodule_search_locations)[0])))
    return [(n, d) for n, d in found
            if not any(d != o and d.startswith(o + os.sep) for _, o in found)]


def source_digest(roots: Iterable[tuple[str, str]] | None = None) -> str:
    """SHA-256 (hex) over every source file under ``roots`` ((package name, directory) pairs, default
    :func:`package_roots`), in order of their package paths; ``__pycache__`` and other suffixes are skipped."""
    files: list[tuple[str, str]] = []
    for name, root in package_roots() if roots is None else roots:
        prefix = name.replace(".", "/")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in filenames:
                if f.endswith(SOURCE_SUFFIXES):
                    rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                    files.append((f"{prefix}/{rel}", os.path.join(dirpath, f)))
    h = hashlib.sha256()
    for rel, path in sorted(files):
        with open(path, "rb") as fh:
            data = fh.read()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _git(args: list[str], cwd: str) -> str:
    with contextlib.suppress(Exception):
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, timeout=5)
        if r.returncode == 0:
            return r.stdout.strip()
    return ""


def code_identity() -> dict[str, str]:
    """``git`` (short commit of the checkout holding the package, or ""), ``git_dirty`` ("yes" when tracked
    files differ from that commit, "no", or "" without git) and ``source_sha256`` (:func:`source_digest`)."""
    roots = package_roots()
    where = roots[0][1] if roots else os.getcwd()
    commit = _git(["rev-parse", "--short", "HEAD"], where)
    dirty = ""
    if commit:
        dirty = "yes" if _git(["status", "--porcelain", "--untracked-files=no"], where) else "no"
    return {"git": commit, "git_dirty": dirty, "source_sha256": source_digest(roots)}
