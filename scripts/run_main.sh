#!/usr/bin/env bash
# The main job: set up (idempotent), then train on the digits with every method on 4 ranks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" "$root/scripts/main_job.py" "$@"
