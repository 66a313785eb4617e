#!/usr/bin/env bash
# The whole test suite: set up (idempotent), the lint (ruff, configured in pyproject.toml), then
# pytest (MPI tests launch their own mpirun). Arguments are pytest options (-x, --durations=N),
# given to both halves below; not test paths, nor options a run needs to itself (--junitxml,
# --basetemp) or a terminal for (--pdb: the halves run in the background).
#
# The Slurm tests (tests/test_slurm.py) spend most of their minutes waiting on Slurm's clock: a
# time limit is checked every 30 s and a job starts on the scheduler's next pass. So they run
# in a second pytest beside the rest, with their own emulated nodes (hvs-, 198.18.1) apart from
# the other tests' (hvc-, 198.18.0) and a cache of their own; their report follows the main one.
# The MPI suites of the collectives and of hvcomm.torch (tests/test_collectives_mpi.py,
# tests/test_torch_mpi.py: no emulated hosts) run after them in that pytest, on the cores the
# Slurm tests leave idle: the halves then take about as long, though the whole is no shorter
# on two busy cores (docs/testing.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
"$root/.venv/bin/ruff" check --no-cache "$root"

pytest=("$root/.venv/bin/python" -m pytest -ra --timeout=900)
slurm_log=$(mktemp "${TMPDIR:-/tmp}/hvcomm-slurm-tests.XXXXXX")
halves=()
interrupted=0
# Ctrl-C reaches both halves from the terminal (each then takes its own hosts down); a SIGTERM
# or SIGHUP to this script is passed on to them as that SIGINT, and the script fails; either
# way it waits for both.
trap ':' INT
trap 'interrupted=143; kill -INT "${halves[@]}" 2>/dev/null || true' TERM HUP
trap 'rm -f "$slurm_log"' EXIT
# A background job starts with SIGINT ignored, and a shell cannot undo an ignore it inherited
# (e.g. when this script is itself started in the background): each half gets the default back
# from `env --default-signal` where coreutils has it (9.1 on), else from `trap -`.
default_int=()
if env --default-signal=INT true 2>/dev/null; then default_int=(env --default-signal=INT); fi
(trap - INT; exec "${default_int[@]}" "${pytest[@]}" -o cache_dir=.pytest_cache/slurm \
    tests/test_slurm.py tests/test_collectives_mpi.py tests/test_torch_mpi.py "$@" \
    > "$slurm_log" 2>&1) &
halves+=("$!")
(trap - INT; exec "${default_int[@]}" "${pytest[@]}" tests --ignore=tests/test_slurm.py \
    --ignore=tests/test_collectives_mpi.py --ignore=tests/test_torch_mpi.py "$@") &
halves+=("$!")

status_of() {  # a half's exit status, once it has ended (a trap interrupts `wait`)
    local status
    while true; do
        status=0
        wait "$1" || status=$?
        if ! kill -0 "$1" 2>/dev/null; then return "$status"; fi
    done
}
main_status=0
status_of "${halves[1]}" || main_status=$?
slurm_status=0
status_of "${halves[0]}" || slurm_status=$?
echo "=== tests/test_slurm.py, test_collectives_mpi.py, test_torch_mpi.py: run beside the rest ==="
cat "$slurm_log"
if [ "$interrupted" -ne 0 ]; then exit "$interrupted"; fi
# pytest's 5 is "no test collected" (a -k that selects none in one half): a failure only in both
if [ "$main_status" -eq 5 ] && [ "$slurm_status" -eq 5 ]; then exit 5; fi
for status in "$main_status" "$slurm_status"; do
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
done
