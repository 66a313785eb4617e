"""The batch scripts under a real Slurm: the local Slurm (scripts/slurm_local.sh) with 2 emulated
nodes at 1 Gbit/s, slurm/ethernet.sbatch launched by mpirun and by srun, a job whose
environment is missing failing at once, and jobs stopped by their time limit or by
`scontrol requeue` that checkpoint, requeue and resume to the weights of an uninterrupted run."""
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from elastic_logs import newest_saved_by_all
from hvcomm.cluster import launch, netem, slurm_local

ROOT = Path(__file__).resolve().parent.parent
UP = ["bash", str(ROOT / "scripts" / "slurm_local.sh")]
if os.geteuid() != 0:
    pytest.skip("the local Slurm needs root (daemons, namespaces, apt-get)",
                allow_module_level=True)
if netem.unsupported_reason():
    pytest.skip(f"no emulated nodes here: {netem.unsupported_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def slurm():
    """The local Slurm with 2 nodes at 1gbit; installed first if need be (skipped only when
    that is impossible here); always taken down."""
    try:  # (an interrupt while the nodes come up takes them down too)
        proc = subprocess.run([*UP, "up", "--nodes", "2", "--rate", "1gbit"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode == 3:
            pytest.skip(f"Slurm cannot be installed here: {proc.stderr.strip()[-500:]}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield slurm_local.slurm_env()
    finally:
        subprocess.run([*UP, "down"], capture_output=True, text=True, timeout=120)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert slurm_local.PREFIX not in listed, f"namespaces left behind:\n{listed}"
        assert subprocess.run(["pgrep", "-x", "slurmctld"]).returncode != 0, "slurmctld left"


def sbatch(env, log: Path, *args) -> str:
    """Submit a batch job from the project's root with ``env``, its output to ``log``; its id."""
    proc = subprocess.run(["sbatch", "--parsable", f"--output={log}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def submit(env, *args, extra_env=None):
    """Submit a batch job and wait for its end; (0 if it COMPLETED, else its exit code or 1;
    its log). Not `sbatch --wait`: its polls grow further apart as the job runs."""
    log = Path(tempfile.mkdtemp(prefix="hvcomm-slurm-test-")) / "job.out"
    ckpt = {"HVCOMM_CHECKPOINT_DIR": str(log.parent / "ckpt")}  # not results/slurm/ckpt-<id>
    jobid = sbatch({**env, **ckpt, **(extra_env or {})}, log, *args)
    fields, text = finish_job(env, jobid, log, timeout=600)
    status = 0 if fields["JobState"] == "COMPLETED" else int(fields["ExitCode"].split(":")[0]) or 1
    return status, f"{fields}\n{text}"


GTOPK = ["slurm/ethernet.sbatch", "scripts/train.py", "--method", "gtopk-0.001",
         "--epochs", "2"]


@pytest.mark.parametrize("launcher, per_node", [("mpirun", 1), ("srun", 2)])
def test_ethernet_job_spans_the_nodes(slurm, launcher, per_node):
    rc, log = submit(slurm, "--nodes=2", f"--ntasks-per-node={per_node}", *GTOPK,
                     extra_env={"LAUNCHER": launcher})
    assert rc == 0, log
    size = 2 * per_node
    assert f"P: {size} ranks = 2 nodes x {per_node} tasks per node" in log, log
    assert f"launched by {launcher}" in log and "shaped to rate 1Gbit" in log, log
    assert "method: gtopk-0.001" in log, log
    # what MPI itself saw: the world size, and ranks on both emulated nodes
    assert f"world size {size} on 2 hosts: node1, node2" in log, log
    acc = re.search(r"final test acc (\d\.\d+)", log)
    assert acc and float(acc.group(1)) > 0.5, log
    assert "exit 0" in log, log


def test_missing_environment_fails_at_once(slurm):
    rc, log = submit(slurm, "--nodes=1", *GTOPK, extra_env={"HVCOMM_VENV": "/nonexistent"})
    assert rc != 0, log
    assert "cannot start this job: no environment at /nonexistent" in log, log
    assert "world size" not in log, log


def test_infiniband_job_refuses_the_pypi_open_mpi(slurm):
    """This environment holds the PyPI Open MPI: the InfiniBand job must stop before any rank
    starts, saying how to build against the site's MPI."""
    rc, log = submit(slurm, "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1",
                     "slurm/infiniband.sbatch", "--epochs", "1")
    assert rc != 0, log
    assert "not the site's MPI" in log and "HVCOMM_SYSTEM_MPI=1" in log, log
    assert "world size" not in log, log


# -- time limits and requeue ----------------------------------------------------------------------
TRAIN = ["scripts/train.py", "--method", "gtopk-0.001", "--epochs", "2"]
ENDED = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # PENDING, RUNNING, REQUEUED... go on


@pytest.fixture(scope="module")
def uninterrupted():
    """The final weights' digest of the same training run straight through: mpirun, 2 ranks on
    this machine, no checkpoint directory (2 ranks: the averages are the same sums in any
    order, so the emulated nodes' run must match it bit for bit)."""
    proc = launch.run(2, [str(ROOT / TRAIN[0]), *TRAIN[1:]], timeout=300,
                      env={"HVCOMM_CHECKPOINT_DIR": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "world size 2 on 1 hosts" in out, out[-3000:]
    return digest_of(out)


def digest_of(log: str) -> str:
    found = re.findall(r"final weights sha256 ([0-9a-f]{64})", log)
    assert len(found) == 1, f"expected one final digest, found {found}"
    return found[0]


def job(env, jobid: str) -> dict:
    """scontrol show job's fields (JobState, Restarts, ...)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", jobid], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_until(what, check, timeout: float, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s\n{describe()}"
        time.sleep(0.5)


def start_job(env, log: Path, ckpt: Path, launcher: str, *sbatch_args, train_args=()):
    return sbatch({**env, "LAUNCHER": launcher, "HVCOMM_CHECKPOINT_DIR": str(ckpt)}, log,
                  "--nodes=2", "--ntasks-per-node=1", *sbatch_args, "slurm/ethernet.sbatch",
                  *TRAIN, *train_args)


def finish_job(env, jobid: str, log: Path, timeout: float):
    """Wait for the job's final state; (its scontrol fields, its log)."""
    read = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    fields = wait_until(f"job {jobid}'s end", lambda: (lambda f: f if f.get("JobState") in ENDED
                                                        else None)(job(env, jobid)),
                        timeout, lambda: f"{job(env, jobid)}\n{read()[-3000:]}")
    return fields, read()


def check_resumed(fields, log, reference, restarts_at_least=1):
    """Requeued, resumed from its checkpoint, COMPLETED, with the uninterrupted run's weights."""
    assert fields["JobState"] == "COMPLETED", (fields, log)
    restarts = int(fields["Restarts"])
    assert restarts >= restarts_at_least, (fields, log)
    for r in range(restarts + 1):  # the header of every run, in the one log (appended)
        assert f"restart: {r}, checkpoints:" in log, log
    assert log.count("world size 2 on 2 hosts: node1, node2") == restarts + 1, log
    resumed = [int(n) for n in re.findall(r"resumed from step (\d+)", log)]
    assert len(resumed) == restarts and resumed == sorted(resumed) and resumed[-1] > 0, log
    assert digest_of(log) == reference, log
    assert log.rstrip().endswith("exit 0"), log[-2000:]
    return resumed


def test_time_limit_checkpoints_requeues_and_resumes(slurm, uninterrupted, tmp_path):
    """--time=1 (Slurm's least) and SIGUSR1 to the batch shell near it: the run takes longer
    than the limit, so it is signalled mid-training (Slurm checks time limits every 30 s: the
    signal comes 29-59 s into the run, 30 s before the kill), checkpoints, requeues itself
    and resumes, perhaps more than once, to the weights of the uninterrupted run."""
    log, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    jobid = start_job(slurm, log, ckpt, "mpirun", "--time=1", "--signal=B:USR1@1",
                      train_args=["--step-sleep", "0.33"])  # about 60 s of training
    fields, log_text = finish_job(slurm, jobid, log, timeout=420)
    resumed = check_resumed(fields, log_text, uninterrupted)
    # every run but the last: the warning, the forward, every rank's checkpoint, the requeue
    runs = int(fields["Restarts"])
    assert log_text.count("SIGUSR1: the time limit is near") >= runs, log_text
    assert log_text.count("SIGUSR1 forwarded to the ranks") >= runs, log_text
    written = [int(n) for n in re.findall(r"checkpoint of step (\d+) written by every rank",
                                          log_text)]
    assert written == resumed, log_text  # each run resumes from the step the last one saved
    assert log_text.count(f"requeued job {jobid}") == runs, log_text
    assert log_text.count(", exit 0\n") == runs + 1, log_text  # every run ended, and cleanly
    assert "TIME LIMIT" not in log_text and fields["JobState"] != "TIMEOUT", log_text


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_scontrol_requeue_resumes(slurm, uninterrupted, tmp_path, launcher):
    """`scontrol requeue` of the running job: Slurm sends SIGTERM to every process of the job
    and requeues it itself. Under srun the ranks have KillWait to checkpoint at their next
    step; under mpirun Open MPI ends them at once (its daemons have the SIGTERM too), so the
    run also checkpoints every 10 steps: either way the requeued run resumes from the newest
    checkpoint every rank has, to the uninterrupted run's weights."""
    log, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    jobid = start_job(slurm, log, ckpt, launcher,
                      train_args=["--step-sleep", "0.05", "--checkpoint-every", "10"])
    read = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    # mid-training, deterministically: once the first of the two epochs has been reported
    wait_until("the first epoch", lambda: "epoch   1/2" in read(), 180, read)
    subprocess.run(["scontrol", "requeue", jobid], env=slurm, check=True, timeout=30)
    fields, log_text = finish_job(slurm, jobid, log, timeout=300)
    resumed = check_resumed(fields, log_text, uninterrupted)
    assert fields["Restarts"] == "1" and len(resumed) == 1, (fields, log_text)
    assert "DUE TO JOB REQUEUE" in log_text and "SIGTERM (requeue" in log_text, log_text
    assert resumed[0] >= 80, log_text  # after epoch 1 (89 steps): at least the checkpoint of 80
    assert "requeued job" not in log_text, log_text  # Slurm requeued it, not the script
    if launcher == "srun":  # KillWait is time enough: the checkpoint of the step it was at
        assert re.search(rf"checkpoint of step {resumed[0]} written by every rank", log_text), \
            log_text


def test_elastic_job_loses_a_node_and_goes_on(slurm, tmp_path):
    """ELASTIC=1: mpirun --with-ft ulfm; both ranks of the second node are SIGKILLed at step
    7 and the two of the first node finish the training, the job COMPLETED with exit 0."""
    out = tmp_path / "elastic"
    out.mkdir()
    rc, log = submit(slurm, "--nodes=2", "--ntasks-per-node=2", "slurm/ethernet.sbatch",
                     "tests/mpi/elastic_train.py", "none", str(out), "--fail", "3:7:host",
                     extra_env={"ELASTIC": "1"})
    assert rc == 0, log
    assert "going on with 2 ranks" in log and "OK size=2" in log, log
    sizes = {f.name: sorted({json.loads(line)["size"] for line in f.read_text().splitlines()
                             if '"size"' in line}) for f in out.glob("steps.rank*.jsonl")}
    assert sizes == {"steps.rank0.jsonl": [2, 4], "steps.rank1.jsonl": [2, 4],
                     "steps.rank2.jsonl": [4], "steps.rank3.jsonl": [4]}, sizes
    assert "exit 0" in log, log


def test_elastic_job_relaunches_on_the_nodes_left_after_a_node_crash(slurm, tmp_path):
    """ELASTIC=1 on 2 nodes x 1 rank, the elastic state saved to disk at every commit: node2
    crashes mid-training (every process on it SIGKILLed: slurmd, Open MPI's daemon, its rank).
    mpirun ends the job; the batch script finds node2 gone and launches again on node1, which
    resumes from the newest commit on disk and finishes: COMPLETED, exit 0, with exactly the
    weights of a reference that trains 2 ranks to that commit and 1 rank from it. (Last in
    this file: node2's slurmd stays down until the local Slurm is started again.)"""
    out, ckpt, log = tmp_path / "run", tmp_path / "ckpt", tmp_path / "job.out"
    out.mkdir()
    train = ["tests/mpi/elastic_train.py", "none", str(out), "--commit-every", "3"]
    jobid = sbatch({**slurm, "ELASTIC": "1", "HVCOMM_CHECKPOINT_DIR": str(ckpt)}, log,
                   "--nodes=2", "--ntasks-per-node=1", "--no-kill", "slurm/ethernet.sbatch",
                   *train, "--sleep", "0.15")
    steps = out / "steps.rank1.jsonl"  # the rank on node2
    read = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    wait_until("step 10 on node2", lambda: steps.exists() and
               steps.read_text().count('"step"') >= 10, 240, read)
    crashed_at = time.time()
    assert slurm_local.crash_node(2) > 0
    # Slurm itself would mark node2 DOWN SlurmdTimeout (60 s) after its last answer and hold
    # the job COMPLETING until then; the batch script has found it lost by now: say so at once
    wait_until("the relaunch", lambda: "relaunching on node1" in read(), 240, read)
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=DOWN",
                    "Reason=crashed by the test"], env=slurm, check=True, timeout=30)
    fields, text = finish_job(slurm, jobid, log, timeout=400)
    assert fields["JobState"] == "COMPLETED" and text.rstrip().endswith("exit 0"), (fields, text)
    assert "lost node(s) node2; 1 left (node1)" in text and "relaunching on node1" in text, text
    resumed = re.findall(r"resumed from commit (\d+) on disk \(.*\) on 1 ranks", text)
    assert len(resumed) == 1 and "OK size=1" in text, text
    # the relaunch's one rank resumes from the newest commit it saved before the crash, by its log
    assert int(resumed[0]) == newest_saved_by_all(out, [0], key="commit"), (resumed, text)
    after = [json.loads(line) for line in (out / "steps.rank0.jsonl").read_text().splitlines()]
    first = min(r["time"] for r in after if r.get("size") == 1)
    print(f"from node2's crash to the first step on node1 alone: {first - crashed_at:.1f} s")

    reference = tmp_path / "reference"  # the script's own files, not hvcomm's copy on disk
    reference.mkdir()
    for n, args in ((2, ["--stop-at-commit-id", resumed[0]]), (1, ["--resume"])):
        ref = launch.run(n, [str(ROOT / train[0]), "none", str(reference), *train[3:], *args],
                         timeout=300)
        assert ref.returncode == 0 and f"OK size={n}" in ref.stdout, ref.stdout + ref.stderr
    got, expected = (torch.load(d / "final.pt") for d in (out, reference))
    assert got.keys() == expected.keys()
    for k in got:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())
