#!/usr/bin/env bash
# Quick start, main job: set up .venv, train a small model twice (float32 and float64),
# dump a window of steps from both and compare them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" plot
exec "$PY" "$root/scripts/demo.py" "$@"
