"""``orbitkv-bench``: one entry point for every benchmark, each a subcommand in its own module.

``orbitkv-bench NAME [ARGS...]`` imports :mod:`orbitkv_fs.tools.bench_NAME` lazily and calls its
``main(argv) -> int`` with the remaining arguments, so a benchmark's heavy dependencies (torch, cupy, a
Mooncake engine) load only when that benchmark runs. Subcommands: codecs, pipeline, ssd, peer, cohort, vllm.
A subcommand whose module is missing, or fails to import for lack of a dependency, exits with status 2 and
says which.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

SUBCOMMANDS = {
    "codecs": "GB/s of each codec direction on the CPU or the GPU, next to baselines in the same run",
    "pipeline": "save/restore through the Manager's whole pipeline",
    "ssd": "SSD log throughput and latency, next to fio",
    "peer": "segment transfer between cache managers",
    "cohort": "request cohorts through an engine with and without the cache",
    "vllm": "real vLLM (CPU build): TTFT restored vs recomputed; staged vs direct KV paths",
}


def _usage() -> str:
    lines = ["usage: orbitkv-bench {" + ",".join(SUBCOMMANDS) + "} [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "orbitkv-bench NAME --help shows a subcommand's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"orbitkv-bench: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = f"orbitkv_fs.tools.bench_{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"orbitkv-bench: subcommand {name!r} is not available in this build ({module_name} missing)",
                  file=sys.stderr)
        else:
            print(f"orbitkv-bench {name}: needs {e.name!r}, which is not installed ({e})", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
