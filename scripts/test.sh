#!/usr/bin/env bash
# Quick start, tests: set up .venv with the test extra and run the whole suite, its tests
# shared among one process per CPU, up to 8 (pytest-xdist; pass -n 0 for one process).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" test
cd "$root"
# one worker per CPU this process may use (nproc: affinity, not psutil's physical cores)
workers="$(nproc)"
[ "$workers" -gt 8 ] && workers=8
exec "$PY" -m pytest --numprocesses "$workers" "$@"
