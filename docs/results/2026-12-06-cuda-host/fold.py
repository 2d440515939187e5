"""Where a sampled bench's host time goes: folds py-spy's raw stacks (``py-spy record --format raw --nolineno``,
one ``frame;frame;... count`` line per stack, root first) of the samples under one entry function.

Prints, for the samples whose stack holds a frame named ROOT (``restore``, ``RestorePipeline.restore``): their
count, then the top frames by self samples (the leaf: a C function of libcuda or numpy, or a Python function),
by inclusive samples (each frame counted once per stack), and by the deepest Python frame (where the time is
spent from Python's side, native frames below it folded in); then the samples not under ROOT (other threads:
what may hold the GIL meanwhile; set-up) by thread and outermost Python frames. Usage:
python fold.py RAW[.gz] ROOT [TOP]"""

from __future__ import annotations

import gzip
import re
import sys
from collections import Counter
from typing import Iterator

_NAME = re.compile(r"^(.*?) \((.*)\)$")


def _label(frame: str) -> str:
    """``func (path)`` as ``func (file)``: the folder left out, the library or module kept."""
    m = _NAME.match(frame)
    if not m:
        return frame
    return f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})"


def _named(frame: str, root: str) -> bool:
    """Whether ``frame`` is function ``root`` (or a method of that name: ``Class.root``)."""
    name = frame.split(" (", 1)[0]
    return name == root or name.endswith("." + root)


def _python(frame: str) -> bool:
    return frame.endswith(".py)")


def read_stacks(path: str) -> Iterator[tuple[list[str], int]]:
    """Each stack of a raw file (gzipped where its name ends in ``.gz``): its frames, root first, and its count."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if n.isdigit():
                yield stack.split(";"), int(n)


def fold(path: str, root: str) -> tuple[int, Counter, Counter, Counter, Counter]:
    """Samples under ``root``, and their self, inclusive and deepest-Python-frame counts; and the other samples
    by their thread (``py-spy --threads``: its first frame) and outermost three Python frames."""
    total, leaf, incl, deep, other = 0, Counter(), Counter(), Counter(), Counter()
    for frames, count in read_stacks(path):
        at = next((i for i, f in enumerate(frames) if _named(f, root)), None)
        if at is None:
            thread = frames[0] if frames[0].startswith("thread ") else ""
            outer = [_label(f) for f in frames if _python(f)][:3]
            other[" / ".join([thread] + outer)] += count
            continue
        frames = frames[at:]
        total += count
        leaf[_label(frames[-1])] += count
        for f in set(map(_label, frames)):
            incl[f] += count
        py = [f for f in frames if _python(f)]
        deep[_label(py[-1]) if py else "(none)"] += count
    return total, leaf, incl, deep, other


def main() -> None:
    path, root = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    total, leaf, incl, deep, other = fold(path, root)
    print(f"{total} samples under {root!r}")
    for title, c in (("self (leaf frame)", leaf), ("deepest Python frame", deep), ("inclusive", incl),
                     ("other samples (thread / outermost Python frames)", other)):
        print(f"\n## {title}\n")
        whole = total + sum(other.values()) if c is other else total  # other's shares: of every sample
        for f, k in c.most_common(top):
            print(f"{k:7d} {k / max(whole, 1):6.1%}  {f}")


if __name__ == "__main__":
    main()
