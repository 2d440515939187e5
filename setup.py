"""Maps the design card's top-level folders onto the one import root ``orbitkv_fs``.

``orbitkv_fs/`` is the core; ``gpu/``, ``server/`` and ``tools/`` install as ``orbitkv_fs.gpu``,
``orbitkv_fs.server`` and ``orbitkv_fs.tools``. Subpackages are discovered so that adding one needs no edit
here; everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {"orbitkv_fs": "orbitkv_fs", "orbitkv_fs.gpu": "gpu", "orbitkv_fs.server": "server", "orbitkv_fs.tools": "tools"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder) if not (name == "orbitkv_fs" and sub.split(".")[0] in ("gpu", "server", "tools"))]

setup(packages=packages, package_dir=package_dir)
