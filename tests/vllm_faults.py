"""A fault-injecting OrbitKV-FS connector for the real-vLLM negative control (test_vllm_real.py).

vLLM loads it through ``kv_connector_module_path: "vllm_faults"`` (tests/ on the engine's PYTHONPATH).
While the file named by ``$ORBITKV_SCRAMBLE_FLAG`` exists, every block it has just loaded from the Manager
is zeroed before the forward pass reads it: outputs must then change, which shows that attention reads the
restored KV (and not something vLLM recomputed behind the connector's back).
"""

from __future__ import annotations

import os
from typing import Any

from orbitkv_fs.connectors.vllm import OrbitKVConnector, OrbitKVConnectorMetadata


class ScramblingOrbitKVConnector(OrbitKVConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        flag = os.environ.get("ORBITKV_SCRAMBLE_FLAG", "")
        meta = self._connector_metadata
        if not (flag and os.path.exists(flag) and isinstance(meta, OrbitKVConnectorMetadata) and meta.loads):
            return
        self._finish_load()  # the restores must have written before they are overwritten
        for t in meta.loads:
            for chunk in t.blocks:
                for b in chunk:
                    if b >= 0:
                        for kv in self._kv_caches.values():
                            kv[b].zero_()
