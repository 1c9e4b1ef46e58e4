#!/usr/bin/env bash
# Creates .venv (if missing) and installs h5cmp into it with the tested torch pinned.
# Usage: source scripts/setup_env.sh [EXTRAS]     (EXTRAS e.g. "test")
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${H5CMP_VENV:-$root/.venv}"
extras="${1:-}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
spec="$root"
[ -n "$extras" ] && spec="$root[$extras]"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$root/.ci/constraints.txt" -e "$spec" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
PY="$venv/bin/python"
