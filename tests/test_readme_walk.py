"""The README's curl walk ("The control plane with curl"), replayed as printed against a real
``orbitkv-cache-manager`` process, every output compared with the README's.

The block is read from README.md itself: ``$ `` lines are commands, the lines after one (up to a blank
line, a ``#`` comment or the next command) its expected output, compared exactly (stdout and stderr of
the command, as a terminal shows them). The commands run in one bash process, in order, in a scratch
directory. What a second run on a shared machine needs, and nothing else, is changed, each change undone
in the outputs before comparing:

* ports: 9091 (HTTP) and 9092 (data plane) become free ports; the manager's command gets ``--http-addr``
  and ``--data-plane`` for them, and ``orbitkv-sample-engine`` commands ``--data-plane``;
* directories: the manager and the sample engine get ``--shm-dir`` of a private directory (shown as
  ``/dev/shm``), ``/tmp/ssd0.bin`` becomes a file in the scratch directory;
* the manager's own output goes to a log file (a terminal would show warnings, e.g. arenas of killed
  managers it reclaimed, between the walk's lines), and the walk waits for ``/healthz`` after starting it,
  as a person does before the next command.

Needs curl and jq (scripts/test.sh installs them) and the package's console scripts next to this Python.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARK = "@@orbitkv-walk-command@@"

pytest.importorskip("fastapi")


def walk() -> list[tuple[str, str]]:
    """``(command, expected output)`` of the README's curl block, in order."""
    text = README.read_text()
    section = text[text.index("## The control plane with curl"):]
    block = section[section.index("```console\n") + len("```console\n"):]
    block = block[:block.index("\n```")]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif not line.strip() or line.startswith("#"):
            if steps:
                steps.append(("", []))  # closes the previous command's output
        else:
            assert steps and steps[-1][0], f"README walk: output line without a command: {line!r}"
            steps[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in steps if cmd]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin() -> str:
    return os.path.dirname(sys.executable)


def test_walk_is_parsed_as_written():
    steps = walk()
    cmds = [c for c, _ in steps]
    assert cmds[1].startswith("orbitkv-cache-manager ") and cmds[1].endswith(" &")
    assert any(c.startswith("orbitkv-sample-engine save") for c in cmds)
    assert all(out for c, out in steps if c.startswith("curl")), "every curl command shows its answer"


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq")
def test_readme_curl_walk_replays_as_printed(tmp_path):
    if shutil.which("orbitkv-cache-manager", path=_bin()) is None or \
            shutil.which("orbitkv-sample-engine", path=_bin()) is None:
        pytest.skip("the package's console scripts are not installed next to this Python")
    http, dp = _free_port(), _free_port()
    shm = tmp_path / "shm"
    shm.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    steps = walk()
    script = ["exec 2>&1"]
    for i, (cmd, _) in enumerate(steps):
        run = cmd.replace("127.0.0.1:9091", f"127.0.0.1:{http}").replace("/tmp/ssd0.bin", str(work / "ssd0.bin"))
        if run.startswith("orbitkv-cache-manager "):
            assert run.endswith(" &")
            run = (run[:-2] + f" --http-addr 127.0.0.1:{http} --data-plane tcp://127.0.0.1:{dp} --shm-dir {shm}"
                   f" > {work / 'manager.log'} 2>&1 &")
        m = re.match(r"orbitkv-sample-engine (\w+)", run)
        if m:
            run = run.replace(m.group(0), f"{m.group(0)} --data-plane tcp://127.0.0.1:{dp} --shm-dir {shm}", 1)
        script.append(f"printf '\\n{MARK}{i}\\n'")  # after output with or without a final newline
        script.append(run)
        if cmd.startswith("orbitkv-cache-manager "):
            script.append(f"echo $! > {work / 'manager.pid'}")
            script.append(f"for _ in $(seq 600); do curl -sf http://127.0.0.1:{http}/healthz >/dev/null && break; "
                          "sleep 0.1; done")
    env = {**os.environ, "PATH": _bin() + os.pathsep + os.environ.get("PATH", "")}
    env.pop("ORBITKV_ADMIN_TOKEN", None)
    try:
        p = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
    finally:  # a walk that stopped early leaves its manager running: stop it (SIGTERM removes its arena)
        pid_file = work / "manager.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
    outputs = re.split(rf"\n{MARK}(\d+)\n", "\n" + p.stdout)
    got = {int(outputs[j]): outputs[j + 1] for j in range(1, len(outputs), 2)}
    log = (work / "manager.log").read_text() if (work / "manager.log").exists() else ""
    assert len(got) == len(steps), f"the walk stopped early:\n{p.stdout}\n{log}"
    for i, (cmd, want) in enumerate(steps):
        out = got[i].rstrip("\n").replace(str(shm), "/dev/shm").replace(f"127.0.0.1:{http}", "127.0.0.1:9091")
        assert out == want, f"README walk, command {i}: $ {cmd}\nwant: {want!r}\ngot:  {out!r}\nmanager log:\n{log}"
    assert p.returncode == 0, p.stdout
    assert not list(shm.iterdir()), "the walk left files in the manager's --shm-dir"
    assert not (work / "ssd0.bin").exists()
