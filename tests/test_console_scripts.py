"""Every console script after the README's install line, as a new user meets it.

* In a fresh virtual environment (no system site packages) made from the README's own line,
  ``pip install -e '.[server,ssd]'`` (no torch, no GPU, no peer stack), each script's ``--help`` works
  and its cheapest real invocation either works or says in one line what to install (status 2, no
  traceback): the manager serves the sample engine's saves and restores, ``orbitkv-inspect`` reads the
  shard it wrote, ``orbitkv-qualify`` the record ``orbitkv-inspect dump`` wrote, each benchmark runs at
  its smallest size or names its missing extra.
* Every option of every script shows its default in ``--help`` (or says itself what happens without it).
* Output cut short by a closed pipe ends quietly (status 141, no ``Broken pipe`` message), for every
  script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from orbitkv_fs.console import HelpFormatter, _NO_DEFAULT
from test_packaging import ROOT
from test_ssd_common import direct_io_dir

SCRIPTS = ("orbitkv-cache-manager", "orbitkv-bench", "orbitkv-inspect", "orbitkv-qualify", "orbitkv-sample-engine")
BENCHES = ("codecs", "pipeline", "ssd", "peer", "cohort")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    import importlib

    from orbitkv_fs.server.cli import build_parser as manager
    from orbitkv_fs.tools import inspect, qualify, sample_engine

    out = {"orbitkv-cache-manager": manager(), "orbitkv-inspect": inspect.build_parser(),
           "orbitkv-qualify": qualify.build_parser(), "orbitkv-sample-engine": sample_engine.build_parser()}
    for name in BENCHES:
        out[f"orbitkv-bench {name}"] = importlib.import_module(f"orbitkv_fs.tools.bench_{name}").build_parser()
    return out


def _walk(name: str, parser: argparse.ArgumentParser):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _walk(f"{name} {sub}", p)


def test_the_readme_install_line_is_the_one_tested():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[server,ssd]' && orbitkv-cache-manager" in readme
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(SCRIPTS), "a console script this test does not cover"


@pytest.mark.parametrize("script", sorted(_parsers()))
def test_every_option_shows_its_default(script):
    """An option's help names its default (the formatter appends it, or the text says it): a user reading
    ``--help`` never has to guess what happens without the flag."""
    bare = []
    for name, parser in _walk(script, _parsers()[script]):
        assert issubclass(parser.formatter_class, HelpFormatter), f"{name}: not the shared help formatter"
        fmt = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, _NO_DEFAULT) or action.required:
                continue
            text = fmt._get_help_string(action) if action.help else ""
            if "default" not in text.lower():
                bare.append(f"{name} {'/'.join(action.option_strings)}")
    assert not bare, f"options whose --help shows no default: {bare}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_package(dest: Path) -> None:
    """What ``pip install -e .`` reads: the build files and the four folders of the import root."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ("orbitkv_fs", "gpu", "server", "tools"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``bin`` of a new venv where the README's install line ran in a copy of this checkout."""
    tmp = tmp_path_factory.mktemp("fresh")
    src = tmp / "orbitkv-fs"
    _copy_package(src)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    line = re.search(r"^(pip install -e '\.\[server,ssd\]')", (ROOT / "README.md").read_text(), re.M).group(1)
    p = subprocess.run(f"{venv}/bin/{line}", shell=True, cwd=src, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"$ {line}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return venv / "bin"


def _run(bin_: Path, *argv: str, rc: int = 0, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run([str(bin_ / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout, env=env,
                       **kw)
    shown = f"$ {' '.join(argv)}\nrc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert p.returncode == rc, shown
    assert "Traceback" not in p.stderr, shown
    return p


def test_fresh_venv_has_no_optional_stacks(fresh):
    p = subprocess.run([str(fresh / "python"), "-c", "import importlib.util as u; print([m for m in "
                        "('torch', 'cupy', 'mooncake', 'zmq', 'transformers') if u.find_spec(m)])"],
                       capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "[]"


def test_every_help_works_in_the_fresh_venv(fresh):
    for argv in [[s, "--help"] for s in SCRIPTS] + [["orbitkv-bench", b, "--help"] for b in BENCHES] + \
            [["orbitkv-inspect", c, "--help"] for c in ("summary", "list", "verify", "dump")] + \
            [["orbitkv-sample-engine", c, "--help"] for c in ("pages", "save", "restore", "clean")]:
        p = _run(fresh, *argv)
        assert p.stdout.startswith("usage:") or p.stdout.startswith("usage: orbitkv-bench"), p.stdout[:200]


def test_manager_sample_engine_inspect_and_qualify_in_the_fresh_venv(fresh, tmp_path):
    """The cheapest real run of each: a manager with an SSD shard serves the sample engine's saves and
    restores; its shard, flushed and closed, is summarised, listed, verified and dumped; the dump is
    qualified."""
    shm, ssd = tmp_path / "shm", direct_io_dir(tmp_path) / "ssd0.bin"
    shm.mkdir()
    http = _free_port()
    dp = f"ipc://{tmp_path}/dp.sock"
    log = open(tmp_path / "manager.log", "w")
    mgr = subprocess.Popen([str(fresh / "orbitkv-cache-manager"), "--pool-size", "16mb", "--shm-dir", str(shm),
                            "--data-plane", dp, "--http-addr", f"127.0.0.1:{http}", "--ssd-cache-path", str(ssd),
                            "--ssd-cache-capacity", "16mb"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "ready:" not in (tmp_path / "manager.log").read_text():
            assert mgr.poll() is None and time.monotonic() < deadline, (tmp_path / "manager.log").read_text()
            time.sleep(0.2)
        eng = ["--data-plane", dp, "--shm-dir", str(shm)]
        p = _run(fresh, "orbitkv-sample-engine", "save", *eng, "--codec", "fp8")
        assert "saved 4 chunks (0 present already): 32 segments, 262144 bytes" in p.stdout, p.stdout
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/admin/flush-dram", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["submitted"]["objects"] == 32
        p = _run(fresh, "orbitkv-sample-engine", "restore", *eng)
        assert "4 present (DRAM 0, lower tier 4, peers 0)" in p.stdout, p.stdout
        p = _run(fresh, "orbitkv-sample-engine", "clean", *eng)
        assert "unregistered sample-tp0" in p.stdout and not list(shm.glob("orbitkv-pages-*"))
    finally:
        mgr.send_signal(signal.SIGTERM)
        assert mgr.wait(60) == 0
        log.close()
    assert not list(shm.iterdir()), "the manager left its arena"
    p = _run(fresh, "orbitkv-inspect", "summary", str(ssd), "--json")
    assert json.loads(p.stdout)["valid"] == 32
    p = _run(fresh, "orbitkv-inspect", "verify", str(ssd))
    assert "32 records, 0 bad" in p.stdout
    npy = tmp_path / "r0.npy"
    p = _run(fresh, "orbitkv-inspect", "dump", str(ssd), "--record", "0", "--out", str(npy))
    assert "bfloat16" in p.stdout and "saved as float32, exactly" in p.stdout, p.stdout
    p = _run(fresh, "orbitkv-qualify", str(npy), "--codec", "turboquant-4", "--role", "key", "--json")
    assert json.loads(p.stdout)["total"]["elements"] == 2 * 16 * 2 * 64
    p = subprocess.run(f"{fresh}/orbitkv-inspect list {ssd} | head -1; echo status ${{PIPESTATUS[0]}} >&2",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("     #") and p.stderr.strip() in ("status 0", "status 141"), p.stderr


def test_benchmarks_run_small_or_name_their_extra(fresh, tmp_path):
    p = _run(fresh, "orbitkv-bench", "codecs", "--device", "cpu", "--repeat", "1")
    assert "using synthetic data" in p.stderr and "fp8_kernel_encode" in p.stdout
    _run(fresh, "orbitkv-bench", "pipeline", "--only", "index", "--index-segments", "2000", "--json")
    p = _run(fresh, "orbitkv-bench", "ssd", "--no-fio", "--only", "throughput", "--bs", "64k", "--qd", "8",
             "--size", "4m", "--dir", str(direct_io_dir(tmp_path)), "--json")
    assert json.loads(p.stdout)["throughput"][0]["tier_write_GBps"] > 0
    for argv, extra in ((["peer"], "peer"), (["cohort", "--quick"], "e2e"),
                        (["pipeline", "--only", "dataplane", "--latency-samples", "10"], "peer")):
        p = _run(fresh, "orbitkv-bench", *argv, rc=2)
        assert len(p.stderr.strip().splitlines()) == 1 and f"[{extra}]" in p.stderr, p.stderr


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory):
    """A shard of two records and a K dump, for scripts that print what they read."""
    from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
    from test_ssd_common import key, segment

    tmp = tmp_path_factory.mktemp("inputs")
    shard = str(direct_io_dir(tmp) / "s.okv")
    with SsdTier(SsdConfig(paths=(shard,), capacity=1 << 20)) as t:
        t.submit(key(0), segment(0))
        t.submit(key(1), segment(1))
        t.flush()
    npy = tmp / "k.npy"
    import numpy as np

    np.save(npy, np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32))
    (tmp / "shm").mkdir()
    return {"shard": shard, "npy": str(npy), "shm": str(tmp / "shm")}


@pytest.mark.parametrize("argv", [["orbitkv_fs.tools.bench", "--help"], ["orbitkv_fs.tools.inspect", "list", "{shard}"],
                                  ["orbitkv_fs.tools.inspect", "summary", "{shard}", "--json"],
                                  ["orbitkv_fs.tools.qualify", "{npy}", "--codec", "fp8", "--role", "key"],
                                  ["orbitkv_fs.tools.sample_engine", "pages", "--shm-dir", "{shm}"]])
def test_output_into_a_closed_pipe_ends_quietly(argv, small_inputs):
    """stdout's reader is gone before the first write (as ``| head`` leaves it once it has its lines): the
    script ends with status 141 and says nothing (no ``Broken pipe``, no traceback)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", *(a.format(**small_inputs) for a in argv)], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(w)
        for f in Path(small_inputs["shm"]).iterdir():
            f.unlink()
    assert p.returncode == 128 + signal.SIGPIPE and "Broken pipe" not in p.stderr and "Traceback" not in p.stderr, \
        p.stderr
