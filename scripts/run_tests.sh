#!/usr/bin/env bash
# The whole test suite: set up (idempotent), then pytest (MPI tests launch their own mpirun).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -ra --timeout=900 tests "$@"
