#!/usr/bin/env bash
# Quick start, main job: set up .venv, train a small CNN in float32 and bfloat16 autocast,
# with and without bugs, dump four steps of each run and compare and localize them.

set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" plot
exec "$PY" "$root/scripts/demo.py" "$@"
