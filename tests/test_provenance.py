"""Provenance of benchmark results: the source digest follows the code, not where it is installed."""

from __future__ import annotations

import shutil

from orbitkv_fs.provenance import code_identity, package_roots, source_digest


def _tree(root, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_source_digest_follows_sources_only(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    _tree(pkg, {"a.py": b"x = 1\n", "kernels/k.cu": b"__global__ void k() {}\n", "notes.txt": b"one"})
    roots = [("orbitkv_fs", str(pkg))]
    first = source_digest(roots)
    assert len(first) == 64 and first == source_digest(roots)
    _tree(pkg, {"notes.txt": b"two", "__pycache__/a.cpython-312.pyc": b"\0"})  # not sources: no change
    assert source_digest(roots) == first
    _tree(pkg, {"a.py": b"x = 2\n"})
    assert source_digest(roots) != first
    _tree(pkg, {"a.py": b"x = 1\n", "b.py": b""})  # a new, empty source file counts too
    assert source_digest(roots) != first


def test_source_digest_is_the_same_for_a_mapped_checkout_and_an_installed_layout(tmp_path) -> None:
    """An editable checkout maps gpu/ into orbitkv_fs.gpu; a wheel keeps it at orbitkv_fs/gpu/."""
    core = {"__init__.py": b"", "manager.py": b"m = 1\n"}
    gpu = {"__init__.py": b"", "engine.py": b"e = 1\n", "kernels/a.cu": b"// a\n"}
    checkout, wheel = tmp_path / "checkout", tmp_path / "site" / "orbitkv_fs"
    _tree(checkout / "orbitkv_fs", core)
    _tree(checkout / "gpu", gpu)
    _tree(wheel, core)
    _tree(wheel / "gpu", gpu)
    mapped = [("orbitkv_fs", str(checkout / "orbitkv_fs")), ("orbitkv_fs.gpu", str(checkout / "gpu"))]
    assert source_digest(mapped) == source_digest([("orbitkv_fs", str(wheel))])
    shutil.rmtree(checkout / "gpu" / "kernels")
    assert source_digest(mapped) != source_digest([("orbitkv_fs", str(wheel))])


def test_code_identity_of_this_installation() -> None:
    import importlib.util
    import os

    roots = dict(package_roots())
    assert "orbitkv_fs" in roots
    gpu = os.path.realpath(list(importlib.util.find_spec("orbitkv_fs.gpu").submodule_search_locations)[0])
    # gpu/ is a root of its own (editable checkout) or inside orbitkv_fs/ (wheel): its sources count either way
    assert any(gpu == d or gpu.startswith(d + os.sep) for d in roots.values())
    ident = code_identity()
    assert set(ident) == {"git", "git_dirty", "source_sha256"}
    assert ident["source_sha256"] == source_digest()
    assert ident["git_dirty"] in (("yes", "no") if ident["git"] else ("",))
