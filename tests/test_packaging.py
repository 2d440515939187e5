"""Packaging: the built wheel holds all four import roots, the core imports without optional stacks,
and ``ans`` without the GPU stack is a clear :class:`CodecUnavailable`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Imports an OrbitKV-FS user may do on a CPU-only machine with only the core dependencies.
BLOCKED = ("cupy", "cupyx", "torch", "fastapi", "starlette", "uvicorn", "kvikio", "transformers", "nvidia")
BLOCKER = textwrap.dedent(f"""
    import sys
    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ImportError(f"blocked for this test: {{name}}")
            return None
    sys.meta_path.insert(0, Blocker())
""")


def _source_copy(dest: Path) -> None:
    """The files of the checkout (tracked and untracked, minus ignored ones), so the build writes
    nothing into the working tree others share."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): copy it whole
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info",
                                                                  "__pycache__", ".venv"))
        return
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    _source_copy(src)
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out), str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("orbitkv_fs-*.whl")
    return whl


def test_wheel_holds_the_four_import_roots(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("orbitkv_fs", "orbitkv_fs/gpu", "orbitkv_fs/server", "orbitkv_fs/tools", "orbitkv_fs/codecs"):
        assert f"{pkg}/__init__.py" in names, pkg
    for must in ("orbitkv_fs/segment.py", "orbitkv_fs/codecs/fp8.py", "orbitkv_fs/tools/qualify.py",
                 "orbitkv_fs/tools/bench.py", "orbitkv_fs/tools/models.py"):
        assert must in names, must
    for kernel in sorted((ROOT / "gpu" / "kernels").glob("*.cu*")):
        assert f"orbitkv_fs/gpu/kernels/{kernel.name}" in names, kernel.name
    # the folders install under the one import root, never as top-level packages
    assert not any(n.split("/")[0] in ("gpu", "server", "tools", "tests") for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    assert "orbitkv-qualify = orbitkv_fs.tools.qualify:main" in scripts
    assert "orbitkv-bench = orbitkv_fs.tools.bench:main" in scripts


def test_unpacked_wheel_imports_and_round_trips(wheel: Path, tmp_path: Path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = BLOCKER + textwrap.dedent(f"""
        sys.path.insert(0, {str(site)!r})
        import numpy as np
        import orbitkv_fs, orbitkv_fs.codecs, orbitkv_fs.tools.qualify
        assert orbitkv_fs.__file__.startswith({str(site)!r}), orbitkv_fs.__file__
        from orbitkv_fs.codecs import decode_segment, encode_segment
        x = np.arange(4096, dtype=np.float16).reshape(32, 128) / 4096
        assert np.array_equal(decode_segment(encode_segment(x, "fp8")).size, x.size)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def _run_blocked(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(body)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_core_imports_without_gpu_torch_or_server_stacks():
    out = _run_blocked("""
        import orbitkv_fs, orbitkv_fs.codecs, orbitkv_fs.segment, orbitkv_fs.errors, orbitkv_fs.keys
        import orbitkv_fs.tools, orbitkv_fs.tools.qualify, orbitkv_fs.tools.bench, orbitkv_fs.tools.models
        import orbitkv_fs.tools.bench_codecs
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
        assert not leaked, leaked
        try:
            import torch
        except ImportError:
            print("blocked")
    """.replace("{blocked!r}", repr(BLOCKED)))
    assert out.returncode == 0 and out.stdout.strip() == "blocked", out.stderr


def test_ans_without_gpu_stack_raises_codec_unavailable():
    out = _run_blocked("""
        import numpy as np
        from orbitkv_fs.codecs import encode_segment, get_codec
        from orbitkv_fs.errors import CodecUnavailable
        for call in (lambda: get_codec("ans"), lambda: encode_segment(np.zeros(8192, np.uint8), "ans")):
            try:
                call()
            except CodecUnavailable as e:
                assert "cupy" in str(e) and "nvCOMP" in str(e), e
            else:
                raise SystemExit("no CodecUnavailable")
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Every optional stack (the server, e2e, gpu and peer extras, torch), as a machine without them has it.
OPTIONAL = BLOCKED + ("prometheus_client", "pydantic", "pydantic_core", "gguf", "accelerate", "safetensors",
                      "mooncake")


def test_suite_collects_without_the_optional_stacks():
    """Each test file imports without the optional extras: what needs a missing stack skips
    (``pytest.importorskip``), no file is a collection error (the GPU machine runs without the server extra)."""
    blocker = BLOCKER.replace(repr(BLOCKED), repr(OPTIONAL)).replace("raise ImportError", "raise ModuleNotFoundError")
    code = blocker + textwrap.dedent("""
        import pytest
        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = p.stdout.strip().splitlines()[-1]
    assert p.returncode == 0 and "error" not in tail, p.stdout[-4000:]
    assert "collected" in tail
