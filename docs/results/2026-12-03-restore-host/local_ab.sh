#!/usr/bin/env bash
# restore_host.py on base (a tree laid out as the build maps it, on PYTHONPATH) and on the installed tree, ROUNDS
# rounds alternating, for each codec: ../2026-12-03-save-host/local_ab.sh with this harness.
# Usage, from the repository root: local_ab.sh BASE_DIR ROUNDS CODEC...
here=$(cd "$(dirname "$0")" && pwd)
HARNESS=$here/restore_host.py exec bash "$here/../2026-12-03-save-host/local_ab.sh" "$@"
