"""``orbitkv-bench``: one entry point for every benchmark, each a subcommand in its own module.

``orbitkv-bench NAME [ARGS...]`` imports :mod:`orbitkv_fs.tools.bench_NAME` lazily and calls its
``main(argv) -> int`` with the remaining arguments, so a benchmark's heavy dependencies (torch, cupy, a
Mooncake engine) load only when that benchmark runs. Subcommands: codecs, pipeline, ssd, peer, cohort,
vllm.
A subcommand that lacks an optional dependency (at import or while it runs), or whose machine cannot run
what it asks (an OrbitKV-FS error such as a codec without its GPU), exits with status 2 and one line
saying what is missing.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from orbitkv_fs.console import entry_point, missing_dependency
from orbitkv_fs.errors import OrbitKVError

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


@entry_point("orbitkv-bench")
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
        return int(importlib.import_module(module_name).main(rest) or 0)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"orbitkv-bench: subcommand {name!r} is not available in this build ({module_name} missing)",
                  file=sys.stderr)
            return 2
        line = missing_dependency(f"orbitkv-bench {name}", e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    except OrbitKVError as e:
        print(f"orbitkv-bench {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
