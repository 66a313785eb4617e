# Sourced by the batch scripts of this folder: the environment check and the job's header.
# Needs: LAUNCH_CHECK (arguments of `python -m hvcomm.cluster.launch check`), NETWORK (words).
# Sets: PY (the environment's python), TRAIN (the training script and its arguments); exports
# the thread count and unbuffered output; prints the job's header, and its end on exit.

cd "${SLURM_SUBMIT_DIR:-.}"
PY="${HVCOMM_VENV:-.venv}/bin/python"
if [ ! -x "$PY" ]; then
  echo "hvcomm: cannot start this job: no environment at ${HVCOMM_VENV:-.venv} (in $PWD)." \
       "Run \`bash scripts/setup_env.sh\` once, outside the job (or sbatch slurm/setup.sbatch)," \
       "or point HVCOMM_VENV at the environment." >&2
  exit 2
fi
# the environment must match the MPI this job launches with (exits 2 with the reason)
"$PY" -m hvcomm.cluster.launch check $LAUNCH_CHECK || exit 2

# the training script (default scripts/train_digits.py) and its arguments
if [ $# -gt 0 ] && [ "${1%.py}" != "$1" ]; then
  TRAIN=("$@")
else
  TRAIN=(scripts/train_digits.py "$@")
fi
[ -f "${TRAIN[0]}" ] || { echo "hvcomm: no training script ${TRAIN[0]} in $PWD" >&2; exit 2; }
method=""; prev=""
for arg in "${TRAIN[@]}"; do
  case "$arg" in --method=*) method=${arg#--method=} ;; esac
  [ "$prev" = --method ] && method=$arg
  prev=$arg
done

nodes_per=${SLURM_NTASKS_PER_NODE:-$(( SLURM_NTASKS / SLURM_JOB_NUM_NODES ))}
echo "== hvcomm job ${SLURM_JOB_ID:-?} ($SLURM_JOB_NAME)"
echo "P: ${SLURM_NTASKS} ranks = ${SLURM_JOB_NUM_NODES} nodes x ${nodes_per} tasks per node"
echo "nodes: ${SLURM_JOB_NODELIST}"
echo "network: ${NETWORK}"
echo "method: ${method:-the script default} (${TRAIN[*]})"
echo "started: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
# the job's last line, however it ends: the time and the exit status
trap 'rc=$?; echo "finished: $(date -u "+%Y-%m-%d %H:%M:%S UTC"), exit $rc"' EXIT
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} PYTHONUNBUFFERED=1
