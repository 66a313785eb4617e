#!/usr/bin/env bash
# A real Slurm on this machine, to try the batch scripts: slurmctld, and one slurmd per
# emulated node (a network namespace with its own hostname behind a shaped link; see
# hvcomm/cluster/netem.py and hvcomm/cluster/slurm_local.py).
#
#   bash scripts/slurm_local.sh up [--nodes N] [--rate 1gbit]   # default 2 nodes, 1gbit
#   sbatch --nodes=2 slurm/ethernet.sbatch --method gtopk-0.001 --epochs 5
#   bash scripts/slurm_local.sh status
#   bash scripts/slurm_local.sh down                            # always: removes everything
#
# Needs root. `up` installs Debian's slurm-wlm, munge and libpmix-dev (srun --mpi=pmix) when
# they are missing (apt-get; exit 3 when that is impossible here), and needs the project's
# environment (bash scripts/setup_env.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(slurm-wlm munge libpmix-dev)

if [ "${1:-}" = up ] && ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null; then
    echo "slurm_local: not a Debian-like system: install Slurm (slurmctld, slurmd, sbatch)," \
         "munge and PMIx with its package manager, then run this again" >&2
    exit 3
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_local: installing ${packages[*]} needs root" >&2
    exit 3
  fi
  echo "slurm_local: installing ${packages[*]} (apt-get)" >&2
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq --no-install-recommends "${packages[@]}"; } >/tmp/slurm_local-apt.log 2>&1; then
    echo "slurm_local: cannot install ${packages[*]} here (no package access?):" >&2
    tail -n 5 /tmp/slurm_local-apt.log >&2
    exit 3
  fi
fi
[ -x "$root/.venv/bin/python" ] || { echo "slurm_local: no environment: run" \
  "bash scripts/setup_env.sh first" >&2; exit 1; }
exec "$root/.venv/bin/python" -m hvcomm.cluster.slurm_local "$@"
