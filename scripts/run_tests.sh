#!/usr/bin/env bash
# The whole test suite: set up (idempotent), the lint (ruff, configured in pyproject.toml), then
# pytest (MPI tests launch their own mpirun). Arguments are pytest options (-x, --durations=N).
#
# The Slurm tests (tests/test_slurm.py) spend most of their minutes waiting on Slurm's clock: a
# time limit is checked every 30 s and a job starts on the scheduler's next pass. So they run
# in a second pytest beside the rest, with their own emulated nodes (hvs-, 198.18.1) apart from
# the other tests' (hvc-, 198.18.0); their report follows the main one's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
"$root/.venv/bin/ruff" check --no-cache "$root"

pytest=("$root/.venv/bin/python" -m pytest -ra --timeout=900)
slurm_log=$(mktemp "${TMPDIR:-/tmp}/hvcomm-slurm-tests.XXXXXX")
slurm_pid=
# interrupted: stop the Slurm half as Ctrl-C would, so that it takes its nodes down
trap '[ -n "$slurm_pid" ] && kill -INT "$slurm_pid" 2>/dev/null; rm -f "$slurm_log"' EXIT
"${pytest[@]}" -p no:cacheprovider tests/test_slurm.py "$@" > "$slurm_log" 2>&1 &
slurm_pid=$!
main_status=0
"${pytest[@]}" tests --ignore=tests/test_slurm.py "$@" || main_status=$?
slurm_status=0
wait "$slurm_pid" || slurm_status=$?
slurm_pid=
echo "======================== tests/test_slurm.py, run beside the rest ========================"
cat "$slurm_log"
# pytest's 5 is "no test collected" (a -k that selects none in one half): a failure only in both
if [ "$main_status" -eq 5 ] && [ "$slurm_status" -eq 5 ]; then exit 5; fi
for status in "$main_status" "$slurm_status"; do
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
done
