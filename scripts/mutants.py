"""Sampled mutation testing: how many small faults planted in a module its tests catch.

Usage (from the repository root)::

    python scripts/mutants.py orbitkv_fs/segment.py --tests tests/test_segment.py --sample 120 --seed 23 \\
        --out docs/results/2026-12-01-mutants/segment.json

It lists every mutation point of the module (its AST), draws ``--sample`` of them with a fixed seed, and for
each one writes the mutated module into a scratch copy of the repository (``git ls-files`` plus the
working tree's changes: the checkout itself is never touched) and runs the tests there (``pytest -x``). A
mutant is *killed* when the tests fail (or time out), *survives* when they pass. Mutations:

* comparisons flipped (``==``/``!=``, ``<``/``>=``, ``<=``/``>``, ``in``/``not in``, ``is``/``is not``);
* constants moved (an integer ``n`` becomes ``n + 1``, ``True``/``False`` swap, a bytes constant's first
  byte changes) -- also module-level constants and enum codes, the values that are bytes on disk;
* checks deleted (an ``if`` whose body raises, returns or continues is removed; an ``assert`` in a function
  too);
* boolean operators swapped (``and``/``or``), ``not`` dropped, ``+``/``-`` swapped.

Docstrings, annotations, decorator and class keyword arguments, f-strings (messages), log calls,
``__all__`` and module-level asserts (checks of the module's own constants at import) are not mutated.
Writes one JSON document: the module, the command, the counts, and every mutant (line, kind, the changed
source line, killed or survived).

A maintained tool was the first choice, but mutmut 3 makes its variants per function (a trampoline picks a
function's mutated copy at call time), so module-level constants such as the record ``VERSION`` or a
``RawReason`` code, survivors the issue names, are outside what it changes; this sampler mutates those too.
With pytest's plugins off a test run takes 2-3 s here, so ``--sample`` above the number of points runs every
mutant.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.LtE: ast.Gt, ast.Gt: ast.LtE,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


@dataclass
class Mutant:
    index: int
    line: int
    kind: str
    before: str
    after: str
    killed: bool | None = None
    seconds: float = 0.0


def _skip_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, ``__all__``."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                mark(a.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "debug", "info", "warning", "error", "exception"):
            mark(node)  # log lines
    # Decorator and class keyword arguments configure a class or function (``dataclass(frozen=True)``,
    # ``msgspec.Struct, gc=False``), and f-strings are messages: neither is logic.
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                mark(d)
        if isinstance(node, ast.ClassDef):
            for kw in node.keywords:
                mark(kw)
        if isinstance(node, ast.JoinedStr):
            mark(node)
    # A module-level assert checks the module's own constants (a struct's size) when it is imported: no
    # input reaches it, and changing it either fails every import or nothing.
    for node in tree.body:
        if isinstance(node, ast.Assert):
            mark(node)
    return skip


def points(tree: ast.Module) -> list[tuple[int, str]]:
    """Every mutation point: ``(node id, kind)``, in source order."""
    skip = _skip_nodes(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _FLIP:
                    out.append((id(node), f"compare:{i}"))
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or (isinstance(v, int) and not isinstance(v, bool)):
                out.append((id(node), "constant"))
            elif isinstance(v, bytes) and v:
                out.append((id(node), "constant"))
        elif isinstance(node, ast.If) and any(isinstance(s, (ast.Raise, ast.Return, ast.Continue, ast.Break))
                                              for s in node.body):
            out.append((id(node), "delete-check"))
        elif isinstance(node, ast.Assert):
            out.append((id(node), "delete-check"))
        elif isinstance(node, ast.BoolOp):
            out.append((id(node), "boolop"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((id(node), "drop-not"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            out.append((id(node), "arith"))
    return out


class _Apply(ast.NodeTransformer):
    def __init__(self, target: int, kind: str) -> None:
        self.target, self.kind = target, kind
        self.result: ast.AST | None = None

    def visit(self, node: ast.AST) -> ast.AST | None:
        if id(node) != self.target:
            return super().visit(node)
        self.result = self._mutate(node)
        return self.result

    def _mutate(self, node: ast.AST) -> ast.AST:
        k = self.kind
        if k.startswith("compare:"):
            i = int(k.split(":")[1])
            node.ops[i] = _FLIP[type(node.ops[i])]()
        elif k == "constant":
            v = node.value
            if isinstance(v, bool):
                node.value = not v
            elif isinstance(v, int):
                node.value = v + 1
            else:
                node.value = bytes([(v[0] + 1) % 256]) + v[1:]
        elif k == "delete-check":
            return ast.copy_location(ast.Pass(), node)
        elif k == "boolop":
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif k == "drop-not":
            return node.operand
        elif k == "arith":
            node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        return node


def mutate(source: str, target_index: int) -> tuple[str, Mutant]:
    """The source of the module with mutation point ``target_index`` applied, and its description."""
    tree = ast.parse(source)
    node_id, kind = points(tree)[target_index]
    node = next(n for n in ast.walk(tree) if id(n) == node_id)
    line = getattr(node, "lineno", 0)
    before = source.splitlines()[line - 1].strip() if line else ""
    apply = _Apply(node_id, kind)
    mutated = apply.visit(tree)
    ast.fix_missing_locations(mutated)
    after = "(removed)" if kind == "delete-check" else ast.unparse(apply.result).splitlines()[0][:160]
    return ast.unparse(mutated), Mutant(target_index, line, kind, before, after)


def _scratch_copy(repo: str) -> str:
    """A copy of the repository's tracked and untracked (not ignored) files."""
    dst = tempfile.mkdtemp(prefix="orbitkv-mutants-")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for f in files:
        if f and os.path.isfile(os.path.join(repo, f)):
            os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(repo, f), os.path.join(dst, f))
    return dst


def run(module: str, tests: list[str], sample: int, seed: int, timeout: float, select: str | None = None) -> dict:
    repo = os.getcwd()
    source = open(module).read()
    pts = points(ast.parse(source))
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(pts)), min(sample, len(pts))))
    scratch = _scratch_copy(repo)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    # Without the installed plugins (schemathesis and others, not needed here) a run starts in a second
    # rather than five.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if select:
        cmd += ["-k", select]
    mutants: list[Mutant] = []
    try:
        # The unmutated module, unparsed the same way, must pass: otherwise every mutant would look killed.
        with open(os.path.join(scratch, module), "w") as f:
            f.write(ast.unparse(ast.parse(source)))
        base = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=timeout, env=env)
        if base.returncode != 0:
            raise SystemExit(f"the tests fail on the unmutated module:\n{base.stdout[-3000:]}")
        for n, i in enumerate(chosen):
            text, m = mutate(source, i)
            with open(os.path.join(scratch, module), "w") as f:
                f.write(text)
            t0 = time.monotonic()
            try:
                r = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=timeout, env=env)
                m.killed = r.returncode != 0
            except subprocess.TimeoutExpired:
                m.killed = True
            m.seconds = round(time.monotonic() - t0, 1)
            mutants.append(m)
            print(f"[{n + 1}/{len(chosen)}] line {m.line} {m.kind}: {'killed' if m.killed else 'SURVIVED'}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    killed = sum(m.killed for m in mutants)
    return {"module": module, "tests": tests, "seed": seed, "points": len(pts), "mutants": len(mutants),
            "killed": killed, "survived": len(mutants) - killed,
            "killed_fraction": round(killed / len(mutants), 4) if mutants else None,
            "command": " ".join(["python", "scripts/mutants.py", module, "--tests", *tests, "--sample", str(sample),
                                 "--seed", str(seed)] + (["-k", repr(select)] if select else [])),
            "survivors": [asdict(m) for m in mutants if not m.killed],
            "all": [asdict(m) for m in mutants]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module")
    p.add_argument("--tests", nargs="+", required=True)
    p.add_argument("--sample", type=int, default=120)
    p.add_argument("--seed", type=int, default=23)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per test run (a hang counts as killed)")
    p.add_argument("-k", dest="select", default=None, help="pytest -k expression (leave out slow tests)")
    p.add_argument("--list", action="store_true", help="only count the mutation points")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.list:
        pts = points(ast.parse(open(args.module).read()))
        print(json.dumps({"module": args.module, "points": len(pts)}))
        return 0
    doc = run(args.module, args.tests, args.sample, args.seed, args.timeout, args.select)
    text = json.dumps(doc, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: doc[k] for k in ("module", "points", "mutants", "killed", "survived", "killed_fraction")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
