"""OrbitKV-FS: a KV-cache storage tier for LLM inference engines.

Import root of the core. Importing it never needs cupy, torch, a server framework or a GPU; the
GPU codec engine lives in :mod:`orbitkv_fs.gpu`, the HTTP control plane in :mod:`orbitkv_fs.server`.
"""

__version__ = "0.1.0"
