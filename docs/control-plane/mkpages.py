"""An engine's KV pages in /dev/shm and its REST registration body (what a connector does)."""
import json, os
import numpy as np, ml_dtypes
from orbitkv_fs.pages import host_engine_pages

pages, descs = host_engine_pages(num_layers=4, num_blocks=64, block_size=16, num_heads=2, head_dim=64)
for name in pages.tensors:
    a = pages.array(name)
    a[...] = np.random.default_rng(0).standard_normal(a.shape).astype(ml_dtypes.bfloat16)
body = {"model": "HuggingFaceTB/SmolLM2-135M", "num_layers": 4, "layer_start": 0, "layer_end": 4,
        "block_size": 16, "num_heads": 2, "head_dim": 64, "dtype": "bfloat16", "engine_id": "vllm-tp0",
        "codec": "fp8",
        "tensors": [{"layer": d.layer, "role": d.role, "layout": d.layout, "shape": d.shape, "strides": d.strides,
                     "dtype": d.dtype, "handle": {"type": "host", "name": os.path.basename(d.handle.path),
                                                  "offset": d.handle.offset}} for d in descs]}
json.dump(body, open("register.json", "w"))
print(os.path.basename(pages.path))
