"""The first cycle's cold batch alone, one engine per process: wall time of two batches of 8 new 1,024-token
prompts (16 tokens each) on an engine with a 128 MiB KV cache, with or without the connector, and what the
connector and the Manager counted meanwhile. Usage: python cold_batch.py KV_CACHE_MIB conn|base"""
import sys, time, tempfile
from pathlib import Path
import httpx
from orbitkv_fs.tools.bench_vllm import ManagerProcess
from orbitkv_fs.tools.vllm_env import VllmEngineProcess, ensure_vllm_venv, vllm_model_dir
from orbitkv_fs.tools.models import SAMPLE_TEXT
kv_mib = int(sys.argv[1]); conn_on = sys.argv[2] == "conn"
tmp = Path(tempfile.mkdtemp())
py = ensure_vllm_venv(); model = vllm_model_dir(Path.home() / ".cache/orbitkv_fs/models")
m = ManagerProcess(tmp)
stats = lambda: httpx.get(f"http://{m.http}/v1/stats", timeout=30).json()
cfg = {"orbitkv.manager": m.data_plane, "orbitkv.chunk_tokens": 256} if conn_on else None
e = VllmEngineProcess(py, {"model": str(model), "connector": cfg, "max_model_len": 2048,
                           "kv_cache_memory_bytes": kv_mib << 20}, tmp=tmp, log=tmp / "vllm.log")
try:
    ids = e("tokenize", texts=[SAMPLE_TEXT * 12])["ids"][0]
    while len(ids) < 1024 + 37 * 20: ids = ids + ids
    e("generate", prompts=[ids[-1024:]], max_tokens=2)
    for rnd in range(2):
        s0 = stats(); c0 = e("connector") if conn_on else {}
        t0 = time.perf_counter()
        prompts = [ids[37 * (i + 8 * rnd):37 * (i + 8 * rnd) + 1024] + [13, 14, 15] for i in range(8)]
        out = e("generate", prompts=prompts, max_tokens=16, one_by_one=False)
        dt = time.perf_counter() - t0
        s1 = stats(); c1 = e("connector") if conn_on else {}
        flat = lambda d, p="": {f"{p}{k}": v for k, v in d.items() if isinstance(v, (int, float))}
        diff = {k: round(v - flat(s0).get(k, 0), 3) for k, v in flat(s1).items() if v != flat(s0).get(k, 0)}
        print("round", rnd, "wall", round(dt, 2), {k: round(c1[k] - c0[k], 3) for k in c1 if k != "type"})
        print("  manager diff", diff)
finally:
    e.close(); m.close()
