"""A rank killed with SIGKILL mid-training ends the whole job, non-zero, within 10 s and with no
process left behind; resuming from the last checkpoint ends with exactly the weights of a run
that was never interrupted (dense, gTop-k, OD-SGD, P3; on one node and on the emulated cluster;
and scripts/train.py from its periodic checkpoints).
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hvcomm.cluster import launch, netem
from mpi_launch import HERE

SCRIPT = str(HERE / "mpi" / "train_resumable.py")
STEPS, KILL_AFTER = 12, 4


class OneNode:
    """How a job is launched on this machine, and what of it is left after it ends."""

    def __init__(self, n):
        self.n = n

    def cmd(self, args):
        return launch.mpirun_cmd(self.n, [SCRIPT, *args])

    def env(self):
        return launch.mpi_env({"HVCOMM_TEST_EXPECT_SIZE": str(self.n)})

    def left_behind(self, directory: Path):
        pids = [int((directory / f"pid.rank{r}").read_text()) for r in range(self.n)]
        return [p for p in pids if alive(p)] + processes_mentioning(str(directory))


class OnEmulatedHosts(OneNode):
    def __init__(self, cluster):
        super().__init__(cluster.hosts)
        self.cluster = cluster

    def cmd(self, args):
        return self.cluster.mpirun_cmd([SCRIPT, *args])

    def env(self):
        return self.cluster.mpirun_env({"HVCOMM_TEST_EXPECT_SIZE": str(self.n)})

    def left_behind(self, directory: Path):
        return super().left_behind(directory) + self.cluster.processes()


def finish(how, args, timeout=300):
    n = how.n
    proc = subprocess.run(how.cmd(args), env=how.env(), capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"OK size={n}" in proc.stdout, out[-4000:]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead; only its parent's wait is missing
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def processes_mentioning(text: str):
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def kill_one_rank(how, args, directory: Path, victim: int):
    """Start the job, SIGKILL rank ``victim`` once it has saved step KILL_AFTER; return how
    long the job took to end after the kill, its exit code, its output and the processes
    left behind."""
    job = subprocess.Popen(how.cmd(args), env=how.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        marker = directory / f"step{KILL_AFTER}.rank{victim}.pt"
        while not marker.exists():
            assert job.poll() is None, f"the job ended before the kill:\n{job.stdout.read()}"
            assert time.monotonic() < deadline, "the job never reached the kill point"
            time.sleep(0.05)
        os.kill(int((directory / f"pid.rank{victim}").read_text()), signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            out, _ = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            out, _ = job.communicate()
            raise AssertionError(f"the job still ran 60 s after a rank was killed:\n{out[-4000:]}")
        took = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
    time.sleep(0.5)  # let the kernel finish reaping
    return took, job.returncode, out, how.left_behind(directory)


def final_weights(directory: Path, n: int):
    return [torch.load(directory / f"final.rank{r}.pt") for r in range(n)]


def check_kill_and_resume(method, how, tmp_path):
    n = how.n
    full, broken = tmp_path / "full", tmp_path / "broken"
    full.mkdir()
    broken.mkdir()
    finish(how, [method, str(full), str(STEPS)])

    took, code, out, left = kill_one_rank(
        how, [method, str(broken), str(STEPS), "--slow-after", str(KILL_AFTER)], broken,
        victim=n - 1)
    print(f"{method} on {n} ranks: the job ended {took:.1f} s after the kill, exit {code}")
    assert code != 0, out[-4000:]
    assert took < 10, f"the job took {took:.1f} s to end after the kill\n{out[-4000:]}"
    assert not left, f"processes left behind after the kill: {left}"
    assert not (broken / "final.rank0.pt").exists()

    out = finish(how, [method, str(broken), str(STEPS), "--resume"])
    resumed_after = int(out.split("resuming after step ")[1].split()[0])
    assert KILL_AFTER <= resumed_after < STEPS - 1, out[-2000:]
    for r, (a, b) in enumerate(zip(final_weights(full, n), final_weights(broken, n))):
        for name in a:
            assert torch.equal(a[name], b[name]), (method, r, name)


@pytest.mark.parametrize("method", ["none", "gtopk", "od-sgd", "p3"])
def test_kill_then_resume_one_node(method, tmp_path):
    check_kill_and_resume(method, OneNode(3), tmp_path)


@pytest.mark.skipif(netem.unsupported_reason() is not None,
                    reason=f"no network emulation here: {netem.unsupported_reason()}")
def test_kill_then_resume_emulated_cluster(tmp_path):
    with netem.EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        check_kill_and_resume("gtopk", OnEmulatedHosts(cluster), tmp_path)


def test_train_resumes_from_its_periodic_checkpoint(tmp_path):
    """What a requeue under mpirun can leave behind: the ranks ended before they could
    checkpoint on the SIGTERM (slurm/common.sh). scripts/train.py --checkpoint-every 10,
    every process of the job SIGKILLed mid-training; started again, it resumes from the newest
    checkpoint every rank has and ends with the weights of a run never interrupted."""
    train = [str(HERE.parent / "scripts" / "train.py"), "--method", "gtopk-0.001",
             "--epochs", "2"]
    env = {"HVCOMM_TEST_EXPECT_SIZE": "2", "HVCOMM_CHECKPOINT_DIR": ""}
    reference = launch.run(2, train, timeout=300, env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    args = [*train, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"]
    job = subprocess.Popen(launch.mpirun_cmd(2, [*args, "--step-sleep", "0.05"]),
                           env=launch.mpi_env(env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "step30.rank1.pt").exists():
            assert job.poll() is None, f"the job ended before the kill:\n{job.stdout.read()}"
            assert time.monotonic() < deadline, "the job never reached step 30"
            time.sleep(0.05)
        for pid in processes_mentioning(str(ckpt)):  # mpirun and both ranks
            os.kill(pid, signal.SIGKILL)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0 and "final weights" not in out, out[-3000:]
    assert not (ckpt / "preempted.json").exists()  # no signal: only the periodic checkpoints
    resumed = launch.run(2, args, timeout=300, env=env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "world size 2" in out, out[-3000:]
    step = int(re.search(r"resumed from step (\d+)", out).group(1))
    assert step >= 30 and step % 10 == 0, out[-3000:]
    digest = re.compile(r"final weights sha256 ([0-9a-f]{64})")
    assert digest.findall(out) == digest.findall(reference.stdout) != [], out[-3000:]
