"""The job's outcome record and the launchers that read it (hvcomm.cluster.outcome,
slurm/common.sh), and durable files (hvcomm.durable, hvcomm.torch.checkpoint): no mpirun."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hvcomm import durable
from hvcomm.cluster import launch, outcome
from hvcomm.torch import checkpoint
from mpi_launch import HERE

ROOT = HERE.parent


@pytest.mark.parametrize("launcher, record, status", [
    (0, {"outcome": "completed", "size": 2}, 0),
    (0, None, 1),                                          # mpirun said 0, the job said nothing
    (0, {"outcome": "failed", "error": "ValueError: x"}, 1),
    (3, {"outcome": "completed"}, 3),                      # the launcher's failure stands
    (3, None, 3),
    (137, {"outcome": "failed", "error": "ValueError: x"}, 137)])
def test_the_verdict_is_completed_only_when_the_job_says_so(tmp_path, launcher, record, status):
    path = tmp_path / "outcome.json"
    if record is not None:
        outcome.write(path, **record)
    got, why = outcome.verdict(path, launcher)
    assert got == status, why
    if record and record.get("error"):
        assert record["error"] in why


def test_a_record_is_written_whole_and_nothing_else_is_left(tmp_path):
    path = tmp_path / "sub" / "outcome.json"
    outcome.write(path, "completed", size=4)
    assert outcome.read(path)["outcome"] == "completed" and outcome.read(path)["size"] == 4
    assert [p.name for p in path.parent.iterdir()] == ["outcome.json"]
    with pytest.raises(ValueError, match="outcome must be"):
        outcome.write(path, "done")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    durable.write(path, lambda f: f.write(b"old"))

    def breaks(f):
        f.write(b"half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        durable.write(path, breaks)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_checkpoints_are_synced_to_disk_and_stale_temporaries_removed(tmp_path, monkeypatch):
    """save() fsyncs the file and then its directory, and removes the temporaries a killed
    writer of the same rank left (not other ranks' files)."""
    stale = tmp_path / ".step3.rank1.pt.99999.tmp"
    other = tmp_path / ".step3.rank2.pt.99999.tmp"
    stale.write_bytes(b"partial")
    other.write_bytes(b"partial")
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    final = checkpoint.save(tmp_path, 4, {"w": torch.arange(3)}, rank=1)
    assert synced[-1] == str(tmp_path), synced            # the directory, after the rename
    assert synced[-2].startswith(str(tmp_path / ".step4.rank1.pt.")), synced  # the file
    assert not stale.exists() and other.exists()
    assert torch.equal(checkpoint.load(tmp_path, 4, rank=1)["w"], torch.arange(3))
    assert final == tmp_path / "step4.rank1.pt"


# -- slurm/common.sh's run_requeueable reads the record ------------------------------------------
def run_requeueable(tmp_path, launcher: str):
    """Source slurm/common.sh as a batch script would and launch ``launcher`` (a shell
    command) with run_requeueable: (its status, its output)."""
    script = (f'source slurm/common.sh\n'
              f'echo "forwarded: ${{FORWARD[*]}}"\n'
              f'run_requeueable sh -c {launcher!r}\n'
              f'echo "status: $?"\n')
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_NTASKS": "1",
           "SLURM_JOB_NUM_NODES": "1", "LAUNCH_CHECK": "", "NETWORK": "test",
           "HVCOMM_CHECKPOINT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "forwarded: " in out and "-x HVCOMM_OUTCOME_FILE" in out, out
    return int(out.split("status: ")[1].split()[0]), out


@pytest.mark.parametrize("launcher, status, says", [
    ("exit 0", 1, "wrote no outcome"),
    ("exit 3", 3, "the launcher exited 3"),
    ('.venv/bin/python -m hvcomm.cluster.outcome_writer completed', 0, "completed on 2 ranks"),
    ('.venv/bin/python -m hvcomm.cluster.outcome_writer failed', 1, "the job failed: boom")])
def test_a_batch_job_fails_unless_its_ranks_recorded_completion(tmp_path, launcher, status, says):
    writer = tmp_path / "writer.py"
    writer.write_text("import os, sys\nfrom hvcomm.cluster import outcome\n"
                      "outcome.write(os.environ['HVCOMM_OUTCOME_FILE'], sys.argv[1], size=2, "
                      "error='boom')\n")
    launcher = launcher.replace("-m hvcomm.cluster.outcome_writer", str(writer))
    (tmp_path / "outcome.json").write_text('{"outcome": "completed"}')  # a previous run's
    got, out = run_requeueable(tmp_path, launcher)
    assert got == status and says in out, out


def test_a_signal_as_a_finished_job_exits_does_not_fail_it(tmp_path):
    """Slurm's time-limit warning can reach the ranks (forwarded by the batch script) just as
    the job ends. Once the program has ended, the preemption handlers must not give SIGUSR1
    back its default action: the process that has recorded "completed" would die of it and
    the launcher report the job failed. Here a one-rank job, signalled every millisecond from
    before its program ends (it waits for the first signal) until it has exited."""
    program = ("import time\n"
               "from hvcomm.torch import preemption\n"
               "preemption.install()\n"
               "import hvcomm.torch as hvd\n"
               "hvd.init()\n"
               "print('listening', flush=True)\n"
               "while not preemption.signalled():\n"
               "    time.sleep(0.001)\n")
    path, errors = tmp_path / "outcome.json", tmp_path / "stderr.txt"
    env = dict(launch.mpi_env({"HVCOMM_OUTCOME_FILE": str(path)}), PYTHONPATH=str(ROOT))
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", program], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout.readline() == "listening\n", errors.read_text()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:  # exited between poll and kill
                break
            time.sleep(0.001)
        assert proc.wait(timeout=10) == 0, errors.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert outcome.verdict(path, proc.returncode)[0] == 0
