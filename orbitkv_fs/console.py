"""What every OrbitKV-FS console script shares: help that shows each flag's default, and a quiet end when
the reader of its output goes away.

Primitives: :class:`HelpFormatter` (pass it as ``formatter_class``: each option's help ends with its
default unless the help already names one), :func:`entry_point` (wrap a ``main(argv) -> int``: output
cut short by ``| head`` ends the command with status 141, as a command killed by SIGPIPE would, with no
traceback and no ``Broken pipe`` message; a missing optional dependency is one line naming what to
install, status 2) and :func:`install_hint` (that line's advice for a module name).

Invariants: a broken pipe is swallowed only when it is stdout's (its reader has gone); the same error from
a socket or another pipe still reaches the caller. Help texts never show a secret: defaults of options
whose value is a secret are None.
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import signal
import stat
import sys
from typing import Callable, Sequence

__all__ = ["HelpFormatter", "entry_point", "install_hint", "missing_dependency"]

_SERVER = "the server extra: pip install 'orbitkv-fs[server]'"
_E2E = "torch and the e2e extra: pip install torch 'orbitkv-fs[e2e]'"
_GPU = "the gpu extra on a CUDA machine: pip install 'orbitkv-fs[gpu]'"
_PEER = "the peer extra: pip install 'orbitkv-fs[peer]'"
#: Top-level module an optional feature imports -> what provides it (the extras of pyproject.toml).
_PROVIDERS = {"fastapi": _SERVER, "starlette": _SERVER, "uvicorn": _SERVER, "prometheus_client": _SERVER,
              "pydantic": _SERVER, "torch": _E2E, "transformers": _E2E, "gguf": _E2E, "accelerate": _E2E,
              "safetensors": _E2E, "cupy": _GPU, "cupyx": _GPU, "kvikio": _GPU, "mooncake": _PEER, "zmq": _PEER,
              "matplotlib": "matplotlib (in the test extra): pip install matplotlib"}


def install_hint(module: str) -> str | None:
    """What to install for ``module`` (a dotted name is looked up by its top package), or None when it
    is not an optional dependency of OrbitKV-FS."""
    return _PROVIDERS.get(module.split(".")[0])


def missing_dependency(prog: str, error: ModuleNotFoundError) -> str | None:
    """The one line ``prog`` prints for ``error``, or None when the missing module is not optional (a bug)."""
    hint = install_hint(error.name or "")
    return None if hint is None else f"{prog}: needs {error.name}, which is not installed; install {hint}"

_NO_DEFAULT = (argparse._HelpAction, argparse._VersionAction, argparse._StoreConstAction,  # store_true/false too
               argparse._AppendConstAction, argparse._CountAction, argparse._SubParsersAction)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with ``(default: X)`` after every option's help that does not say its default.

    An option whose default is None must say in its help what happens without it (the formatter cannot
    guess); ``tests/test_console_scripts.py`` holds every script to that."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or not action.option_strings or action.required
                or isinstance(action, _NO_DEFAULT) or action.default in (None, argparse.SUPPRESS)):
            return text
        value = action.default
        if isinstance(value, (list, tuple)):
            shown = " ".join(str(v) for v in value) or "none"
        else:
            shown = str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _stdout_reader_gone() -> bool:
    """stdout is a pipe or socket whose reading end is closed."""
    try:
        fd = sys.__stdout__.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def entry_point(prog: str) -> Callable[[Callable[[Sequence[str] | None], int]], Callable[[Sequence[str] | None], int]]:
    """Decorator: ``main`` as console script ``prog``: its status; 141 once stdout's reader has gone; 2 with
    one line on stderr when an optional dependency is missing."""
    return functools.partial(_wrap, prog)


def _wrap(prog: str, main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> int:
        try:
            try:
                return main(argv)
            finally:
                sys.stdout.flush()  # what is still buffered fails here, not at interpreter exit
        except ModuleNotFoundError as e:
            line = missing_dependency(prog, e)
            if line is None:
                raise
            print(line, file=sys.stderr)
            return 2
        except BrokenPipeError:
            if not _stdout_reader_gone():
                raise
            # Nothing more can be written; point stdout at /dev/null so the interpreter's own final flush
            # is silent too.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.__stdout__.fileno())
            os.close(devnull)
            return 128 + signal.SIGPIPE

    return run
