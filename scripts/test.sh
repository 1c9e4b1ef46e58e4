#!/usr/bin/env bash
# Quick start, tests: set up .venv with the test extra and run the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" test
cd "$root"
exec "$PY" -m pytest "$@"
