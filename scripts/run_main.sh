#!/usr/bin/env bash
# The main job: set up (idempotent), then train the three workloads on 4 ranks, each method.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" "$root/scripts/main_job.py" "$@"
