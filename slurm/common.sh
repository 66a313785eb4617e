# Sourced by the batch scripts of this folder: the environment check and the job's header.
# Needs: LAUNCH_CHECK (arguments of `python -m hvcomm.cluster.launch check`), NETWORK (words).
# Sets: PY (the environment's python), TRAIN (the training script and its arguments), nodes_per
# (ranks per node), FORWARD (mpirun's -x for each HVCOMM_* variable); exports the thread
# count, unbuffered output, HVCOMM_CHECKPOINT_DIR and HVCOMM_OUTCOME_FILE; prints the job's
# header, and its end on exit. Defines run_requeueable and run_relaunching (below), which the
# batch scripts launch with.

cd "${SLURM_SUBMIT_DIR:-.}"
# -- time limits, preemption and requeue ----------------------------------------------------------
# The batch scripts ask for SIGUSR1 to the batch shell before the time limit
# (#SBATCH --signal=B:USR1@<s>) and are requeueable (#SBATCH --requeue; --open-mode=append: the
# requeued run appends to the same log). run_requeueable starts the launcher in the background
# and waits for it: bash runs a trap only after the foreground command has ended, so a
# foreground mpirun would hold the signal back until the job's end.
#   SIGUSR1 (the time limit is near): forwarded to the launcher once the ranks listen (the
#     training script writes $HVCOMM_CHECKPOINT_DIR/listening when every rank has its handlers;
#     a script that never does is left to run to the limit). mpirun and srun both pass SIGUSR1
#     on to every rank (measured). The ranks checkpoint at their next step boundary
#     (hvcomm.torch.preemption), rank 0 writes $HVCOMM_CHECKPOINT_DIR/preempted.json last, and
#     the ranks exit 0; then this shell runs `scontrol requeue` on its own job and exits 0. The
#     requeued run (same job id and checkpoint directory, SLURM_RESTART_COUNT one more) resumes.
#   SIGTERM (scontrol requeue, preemption, scancel, the time limit itself): measured on Slurm
#     22.05 (scripts/slurm_local.sh, proctrack/linuxproc): Slurm sends SIGCONT and SIGTERM at the
#     same moment to every process of the job (this shell, srun or mpirun and Open MPI's
#     daemons, every rank), and SIGKILL KillWait seconds later (slurm.conf; default 30 s, 15 s on
#     the local Slurm). The ranks have the signal themselves and checkpoint at their next step
#     if they are left that long. Under srun they are (srun waits KillWait + 2 s for its tasks;
#     a checkpoint was written with 2 s steps). Under mpirun they are not: Open MPI's daemons
#     (started by srun) end on the SIGTERM and mpirun then ends the ranks at once. With 50 ms
#     steps the ranks still checkpointed first; with 2 s steps they did not. Then the requeued
#     run resumes from the newest checkpoint every rank has (train.py
#     --checkpoint-every N), or from the start. This shell never requeues on SIGTERM: Slurm
#     requeues a requeued or preempted job itself, and a cancelled job must stay cancelled.
# Timing, measured: slurmctld checks time limits every 30 s. The --signal warning comes at the
# first check that finds the job within sig_time + 30 s of its end (with --time=1 and @10: 25 s
# and 28 s into the run; the manual warns of up to 60 s early). The kill comes at the first
# check after the limit (85 s into a 1-minute job). A requeued job waits cred_expire seconds
# (AuthInfo; default 120 s, 10 s on the local Slurm), then a scheduler pass.
export HVCOMM_CHECKPOINT_DIR=${HVCOMM_CHECKPOINT_DIR:-$PWD/results/slurm/ckpt-${SLURM_JOB_ID:-0}}
# -- the job's own outcome -------------------------------------------------------------------------
# mpirun can exit 0 after ranks or a node's daemon died (always under --with-ft ulfm), so its
# status alone does not say that training finished. The ranks write this file as they end
# (hvcomm.cluster.outcome: "completed" by rank 0 once every rank ended with status 0, or
# "failed" with the reason); run_requeueable reports a failure, whatever the launcher returned,
# when it does not say completed.
export HVCOMM_OUTCOME_FILE="$HVCOMM_CHECKPOINT_DIR/outcome.json"

# the traps are set now: a signal during the environment check must not end this shell unseen
HVCOMM_SIGNAL="" HVCOMM_LAUNCHER=""
hvcomm_on_usr1() {
  HVCOMM_SIGNAL=${HVCOMM_SIGNAL:-USR1}
  echo "hvcomm: $(date -u +%T) SIGUSR1: the time limit is near"
}
hvcomm_on_term() {
  HVCOMM_SIGNAL=TERM
  echo "hvcomm: $(date -u +%T) SIGTERM (requeue, preemption, cancel or time limit)"
  [ -n "$HVCOMM_LAUNCHER" ] || exit 143
  echo "hvcomm: the ranks have it too, and checkpoint at their next step if they can"
}
trap hvcomm_on_usr1 USR1
trap hvcomm_on_term TERM

run_requeueable() {  # the launcher's command line
  local marker="$HVCOMM_CHECKPOINT_DIR/preempted.json" rc=0 step forwarded=""
  local listening="$HVCOMM_CHECKPOINT_DIR/listening"
  mkdir -p "$HVCOMM_CHECKPOINT_DIR"
  # both written again by this run's ranks: listening once every rank has its handlers (a
  # SIGUSR1 before that would end the ranks, and a script that never writes it is left to
  # run), preempted.json once every rank has checkpointed
  rm -f "$marker" "$listening" "$HVCOMM_OUTCOME_FILE"
  if [ "$HVCOMM_SIGNAL" = USR1 ]; then
    echo "hvcomm: the time limit is near before the training started: requeued without it"
    requeue_self "the last checkpoint in $HVCOMM_CHECKPOINT_DIR, if any"
  fi
  "$@" &
  HVCOMM_LAUNCHER=$!
  # each trapped signal ends a wait early: wait again until the launcher has ended
  while kill -0 "$HVCOMM_LAUNCHER" 2>/dev/null; do
    if [ "$HVCOMM_SIGNAL" = USR1 ] && [ -z "$forwarded" ]; then
      if [ -f "$listening" ]; then
        echo "hvcomm: SIGUSR1 forwarded to the ranks, which checkpoint at their next step"
        kill -USR1 "$HVCOMM_LAUNCHER" 2>/dev/null || true
        forwarded=1
      else
        sleep 1  # the ranks are starting (or the script does not listen: then until the end)
      fi
    else
      wait "$HVCOMM_LAUNCHER" || true
    fi
  done
  wait "$HVCOMM_LAUNCHER" || rc=$?  # its exit status (bash keeps it)
  if [ ! -f "$marker" ]; then
    if [ -n "$HVCOMM_SIGNAL" ]; then
      echo "hvcomm: SIG$HVCOMM_SIGNAL, and no checkpoint written by every rank (exit $rc)"
    fi
    local status=0  # the launcher's status, or 1 when it says 0 but the job did not complete
    "$PY" -m hvcomm.cluster.outcome "$HVCOMM_OUTCOME_FILE" "$rc" || status=$?
    return "$status"
  fi
  step=$(grep -o '"step": [0-9]*' "$marker" | grep -o '[0-9]*$' || echo "?")
  echo "hvcomm: checkpoint of step $step written by every rank ($marker)"
  if [ "$HVCOMM_SIGNAL" = TERM ]; then
    echo "hvcomm: not requeueing: Slurm ends this job (a requeue or a preemption requeues it" \
         "by itself); the next run resumes from step $step"
    return "$rc"
  fi
  requeue_self "step $step"
}

# -- a lost node costs one relaunch (ELASTIC=1) ----------------------------------------------------
# Open MPI 5's runtime cannot run through the loss of a node's daemon (a node crash): mpirun ends
# the job. run_relaunching then asks each node of the allocation to run `true` (srun, all at
# once, 30 s); if some do not answer, it launches again on those that do, down to
# HVCOMM_MIN_NODES (default 1), and the elastic script goes on from the newest state every rank
# saved to disk (HVCOMM_ELASTIC_SAVE_EVERY commits, default 1 here; hvcomm.torch.elastic). Slurm
# ends a job whose node fails unless it was submitted with `sbatch --no-kill`. No relaunch when
# every node answers (the job failed by itself) or after a signal (run_requeueable has dealt
# with it: a requeue, a preemption or a cancel).
run_relaunching() {  # mpirun, then its arguments without -n and --host, then the program
  local mpirun=$1 least=${HVCOMM_MIN_NODES:-1} status node i
  shift
  local nodes=() alive=() lost=() probes=() hosts
  read -r -a nodes <<< "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')"
  while true; do
    hosts=$(printf "%s:$nodes_per," "${nodes[@]}")
    status=0
    run_requeueable "$mpirun" -n $(( ${#nodes[@]} * nodes_per )) --host "${hosts%,}" "$@" \
      || status=$?
    [ "$status" = 0 ] && return 0
    if [ -n "$HVCOMM_SIGNAL" ]; then
      echo "hvcomm: SIG$HVCOMM_SIGNAL: not relaunched (exit $status)"
      return "$status"
    fi
    probes=()
    for node in "${nodes[@]}"; do
      timeout 30 srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap true >/dev/null 2>&1 &
      probes+=($!)
    done
    alive=() lost=()
    for i in "${!nodes[@]}"; do
      # a trapped signal ends a wait early: wait again until the probe has ended
      while kill -0 "${probes[$i]}" 2>/dev/null; do wait "${probes[$i]}" || true; done
      if wait "${probes[$i]}"; then alive+=("${nodes[$i]}"); else lost+=("${nodes[$i]}"); fi
    done
    if [ ${#lost[@]} = 0 ]; then
      echo "hvcomm: every node answers: the job failed by itself (exit $status); not relaunched"
      return "$status"
    fi
    echo "hvcomm: $(date -u +%T) lost node(s) ${lost[*]}; ${#alive[@]} left (${alive[*]})"
    if [ ${#alive[@]} -lt "$least" ]; then
      echo "hvcomm: fewer nodes left than HVCOMM_MIN_NODES=$least: the job stops (exit $status)"
      return "$status"
    fi
    nodes=("${alive[@]}")
    echo "hvcomm: $(date -u +%T) relaunching on ${nodes[*]} from the newest state saved to disk"
  done
}

requeue_self() {  # what the next run resumes from
  # scontrol requeue sends this shell SIGTERM too: ignored, so that the log gets its last lines
  trap '' TERM
  if scontrol requeue "$SLURM_JOB_ID"; then
    echo "hvcomm: $(date -u +%T) requeued job $SLURM_JOB_ID; the next run resumes from $1"
    exit 0
  fi
  echo "hvcomm: scontrol requeue failed (a job submitted with --no-requeue?): submit again" \
       "with HVCOMM_CHECKPOINT_DIR=$HVCOMM_CHECKPOINT_DIR to resume from $1" >&2
  exit 1
}

# -- the environment, the training script, the header ---------------------------------------------
PY="${HVCOMM_VENV:-.venv}/bin/python"
if [ ! -x "$PY" ]; then
  echo "hvcomm: cannot start this job: no environment at ${HVCOMM_VENV:-.venv} (in $PWD)." \
       "Run \`bash scripts/setup_env.sh\` once, outside the job (or sbatch slurm/setup.sbatch)," \
       "or point HVCOMM_VENV at the environment." >&2
  exit 2
fi
# the environment must match the MPI this job launches with (exits 2 with the reason)
"$PY" -m hvcomm.cluster.launch check $LAUNCH_CHECK || exit 2

# the training script (default scripts/train.py) and its arguments
if [ $# -gt 0 ] && [ "${1%.py}" != "$1" ]; then
  TRAIN=("$@")
else
  TRAIN=(scripts/train.py "$@")
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
echo "restart: ${SLURM_RESTART_COUNT:-0}, checkpoints: $HVCOMM_CHECKPOINT_DIR"
# the job's last line, however it ends: the time and the exit status
trap 'rc=$?; echo "finished: $(date -u "+%Y-%m-%d %H:%M:%S UTC"), exit $rc"' EXIT
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} PYTHONUNBUFFERED=1
if [ "${ELASTIC:-0}" = 1 ]; then  # a relaunch after a lost node resumes from this state
  export HVCOMM_ELASTIC_SAVE_EVERY=${HVCOMM_ELASTIC_SAVE_EVERY:-1}
fi
# mpirun's -x for every HVCOMM_* variable (the outcome file, elastic settings): Open MPI passes
# only OMPI_* variables to the other nodes by itself
FORWARD=()
for name in $(compgen -e); do
  case "$name" in HVCOMM_*) FORWARD+=(-x "$name") ;; esac
done

