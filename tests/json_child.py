"""A child Python process driven over stdin/stdout with JSON lines: what the multi-process tests (Manager
processes sharing through peers) use to run each Manager in its own process.

The child program prints one JSON "hello" line when ready, then answers each command line with one JSON
line; closing its stdin ends it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any, Callable, Iterator


class JsonChild:
    def __init__(self, program: str, cfg: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", program, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.hello = json.loads(self.proc.stdout.readline())

    def __call__(self, op: str, **kw: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child process exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def spawner(factory: Callable[..., JsonChild]) -> Iterator[Callable[..., JsonChild]]:
    """``make(**cfg)`` starts a child; every child made is closed at the end."""
    made: list[JsonChild] = []

    def make(**cfg: Any) -> JsonChild:
        child = factory(**cfg)
        made.append(child)
        return child

    try:
        yield make
    finally:
        for child in made:
            child.close()
