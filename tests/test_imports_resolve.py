"""Every import in the package names a module that exists, including the lazy ones inside functions that
only a GPU (or an optional extra) ever runs: a module moved into a subpackage keeps ``from .gpu import``
lines that resolve nowhere, and the GPU path then quietly falls back to the host codecs (the Manager
catches ImportError there), which only a GPU benchmark would notice."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

#: The package and the folders the build maps into it (server/, tools/, gpu/ live beside orbitkv_fs/).
PACKAGES = ("orbitkv_fs", "orbitkv_fs.server", "orbitkv_fs.tools", "orbitkv_fs.gpu")


def _relative_imports() -> list[tuple[str, int, str]]:
    found = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed as a package"
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(root.rglob("*.py")):
            parts = tuple(package.split(".")) + path.relative_to(root).with_suffix("").parts
            module_package = parts[:-1]  # a module's package; an __init__'s package is its own folder
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = module_package[:len(module_package) - node.level + 1]
                    name = ".".join(base + ((node.module,) if node.module else ()))
                    found.append((f"{path}", node.lineno, name))
    return found


def test_every_relative_import_names_an_existing_module():
    imports = _relative_imports()
    assert len(imports) > 100  # the walk did see the package
    missing = [f"{p}:{line}: {name}" for p, line, name in imports if not _exists(name)]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
