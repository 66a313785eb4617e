#!/usr/bin/env bash
# The whole test suite: set up (idempotent), the lint (ruff, configured in pyproject.toml), then
# pytest (MPI tests launch their own mpirun).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
"$root/.venv/bin/ruff" check --no-cache "$root"
exec "$root/.venv/bin/python" -m pytest -ra --timeout=900 tests "$@"
