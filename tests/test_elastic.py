"""hvcomm.torch.elastic on MPI's fault tolerance: a job launched with ``mpirun --with-ft ulfm``
loses ranks (SIGKILL; every rank of an emulated host, its daemon alive; an escaping exception
with on_exception="leave"; two in a row) and
finishes on the survivors with exactly the weights of a reference that trains on the old size
up to the last commit and on the new size from that commit (two plain jobs joined by the
committed state); below min_np every survivor stops with a clear error; without fault
tolerance a failure ends the job as before. Every job must end by itself."""
import json
import re
import subprocess
import sys
import time

import pytest
import torch

from hvcomm.cluster import launch, netem, outcome
from elastic_logs import logged, logged_ranks, newest_saved_by_all
from mpi_launch import HERE

SCRIPT = str(HERE / "mpi" / "elastic_train.py")
COMMIT_EVERY = 3


def job(n, method, out, *args, ft=True, env=None, mpi_args=(), timeout=180):
    out.mkdir(parents=True, exist_ok=True)
    cmd = launch.mpirun_cmd(n, [SCRIPT, method, str(out), "--commit-every",
                                str(COMMIT_EVERY), *args], mpi_args, fault_tolerant=ft)
    env = launch.mpi_env({"HVCOMM_TEST_EXPECT_SIZE": str(n), **(env or {})})
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end in {timeout} s:\n{e.stdout}\n{e.stderr}"[-6000:])


def finished(proc, size):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(rf"^OK size={size} ", proc.stdout, re.M), out[-4000:]
    return out


_references = {}  # (method, sizes, commits): final weights, shared by the tests that need them


def reference(tmp, method, sizes, commits):
    """Train on sizes[0] ranks up to commits[0], on sizes[1] from it up to commits[1], ...:
    each stage a plain job (no fault tolerance) that resumes the previous stage's commit."""
    key = (method, tuple(sizes), tuple(commits))
    if key not in _references:
        out = tmp / "reference"
        for i, n in enumerate(sizes):
            args = (["--resume"] if i else []) + (["--stop-at-commit", str(commits[i])]
                                                  if i < len(commits) else [])
            finished(job(n, method, out, *args, ft=False), n)
        _references[key] = torch.load(out / "final.pt")
    return _references[key]


def assert_same_weights(a_dir, expected):
    got = torch.load(a_dir / "final.pt")
    assert got.keys() == expected.keys()
    for k in got:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())


def sizes_logged(directory):
    """Every world size a step was completed at, per world rank."""
    return {rank: sorted({row["size"] for row in logged(directory, rank) if "size" in row})
            for rank in logged_ranks(directory)}


def last_commit_before(step):
    return step // COMMIT_EVERY * COMMIT_EVERY


@pytest.mark.parametrize("method, victim, how", [  # (Random-k keeps only the step count)
    ("none", 3, "kill"), ("none", 3, "raise"), ("none", 0, "kill"), ("gtopk", 3, "kill"),
    ("powersgd", 3, "kill"), ("od-sgd", 3, "kill"), ("p3", 3, "kill")])
def test_a_lost_rank_is_survived_exactly(tmp_path, method, victim, how):
    """4 ranks, one ends mid-epoch (step 10 of 48, after its backward pass, while the others
    wait for its gradients): SIGKILLed, or ("raise") an exception escapes with
    on_exception="leave". The job finishes every epoch on 3 ranks, exit status 0, with the
    reference's weights (gTop-k: each survivor's residuals as of the commit). Losing rank 0
    renumbers the survivors and moves the source of sync() to the old rank 1. (Commit 9,
    restored here, is usually the next test's too: then they share the reference.)"""
    fail_at = 10
    proc = job(4, method, tmp_path / "a", "--fail", f"{victim}:{fail_at}:{how}",
               env={"HVCOMM_ELASTIC_ON_EXCEPTION": "leave"} if how == "raise" else None)
    out = finished(proc, 3)
    assert "going on with 3 ranks" in out
    if how == "raise":
        assert f"RuntimeError: rank {victim} fails on purpose" in out
    seen = sizes_logged(tmp_path / "a")
    assert seen[victim] == [4], seen
    assert all(seen[r] == [3, 4] for r in range(4) if r != victim), seen
    expected = reference(tmp_path, method, [4, 3], [last_commit_before(fail_at)])
    assert_same_weights(tmp_path / "a", expected)


def restored_steps(directory):
    """The step each surviving rank restored in its recovery (from its reset callback)."""
    return {row["restored"] for rank in logged_ranks(directory)
            for row in logged(directory, rank) if "restored" in row}


# After its gradients went: residuals (gTop-k), a delayed step in flight (OD-SGD); inside the
# commit: which commit is restored. Each other kind of state through a restore: the test above.
@pytest.mark.parametrize("point, method", [("after", "gtopk"), ("after", "od-sgd"),
                                           ("commit", "none"), ("commit", "od-sgd")])
def test_a_rank_killed_around_a_commit_is_survived_exactly(tmp_path, method, point):
    """Rank 3 of 4 is killed in step 8, whose end is a commit: after its opt.step() (its
    gradients sent), or inside the commit once it has saved it. The survivors must restore
    the same commit, the newest they all have by their own logs (9 when the step completed
    everywhere, else 6),
    and end with exactly the weights of the reference trained on 4 ranks to that commit and on
    3 from it (the last rank: the survivors keep their ranks, and their residuals are the
reference's ranks' own). Killed before its gradients are sent:
test_a_lost_rank_is_survived_exactly."""
    proc = job(4, method, tmp_path / "a", "--fail", f"3:8:{point}")
    out = finished(proc, 3)
    restored = restored_steps(tmp_path / "a")
    assert restored == {newest_saved_by_all(tmp_path / "a", [0, 1, 2])} and restored <= {6, 9}, \
        (restored, out[-3000:])
    expected = reference(tmp_path, method, [4, 3], [restored.pop()])
    assert_same_weights(tmp_path / "a", expected)


def test_two_failures_in_a_row(tmp_path):
    proc = job(4, "none", tmp_path / "a", "--fail", "3:7", "2:16")
    out = finished(proc, 2)
    assert "going on with 3 ranks (recovery 1)" in out and "with 2 ranks (recovery 2)" in out
    seen = sizes_logged(tmp_path / "a")
    assert seen == {0: [2, 3, 4], 1: [2, 3, 4], 2: [3, 4], 3: [4]}, seen
    expected = reference(tmp_path, "none", [4, 3, 2],
                         [last_commit_before(7), last_commit_before(16)])
    assert_same_weights(tmp_path / "a", expected)


def test_a_failure_during_a_recovery_is_survived(tmp_path):
    """Rank 3 dies at step 7; rank 2 dies in its reset callback, during that recovery (the
    others then wait for it in sync()): the survivors recover again, from the same commit."""
    proc = job(4, "none", tmp_path / "a", "--fail", "3:7", "2:0:reset")
    out = finished(proc, 2)
    assert "going on with 2 ranks" in out, out[-3000:]
    seen = sizes_logged(tmp_path / "a")
    assert seen == {0: [2, 4], 1: [2, 4], 2: [4], 3: [4]}, seen
    expected = reference(tmp_path, "none", [4, 2], [last_commit_before(7)])
    assert_same_weights(tmp_path / "a", expected)


def test_an_exception_on_every_rank_ends_the_job_with_an_error(tmp_path):
    """Outside elastic.run too, an escaping exception aborts the whole job, fault tolerance
    on."""
    script = tmp_path / "every_rank_raises.py"
    script.write_text("import hvcomm.torch as hvd\nhvd.init()\n"
                      "raise RuntimeError(f'rank {hvd.rank()} cannot start')\n")
    proc = subprocess.run(launch.mpirun_cmd(3, [str(script)], fault_tolerant=True),
                          env=launch.mpi_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "cannot start" in out and "aborting the whole job" in out, out[-3000:]


ENDINGS = str(HERE / "mpi" / "elastic_endings.py")


def ending(n, mode, out, timeout=90):
    """Run elastic_endings.py MODE on n ranks with fault tolerance and its outcome recorded:
    (the job's status, why, mpirun's output, the record); it must end within ``timeout``."""
    out.mkdir(parents=True, exist_ok=True)
    record = out / "outcome.json"
    try:
        status, why, proc = launch.run_with_outcome(n, [ENDINGS, mode, str(out)], record,
                                                    fault_tolerant=True, timeout=timeout,
                                                    env={"HVCOMM_TEST_EXPECT_SIZE": str(n)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end in {timeout} s:\n{e.stdout}\n{e.stderr}"[-6000:])
    return status, why, proc.stdout + proc.stderr, outcome.read(record)


@pytest.mark.parametrize("who", ["all", "0"])
def test_a_bug_inside_elastic_run_ends_the_job_with_its_error(tmp_path, who):
    """A ValueError inside elastic.run, on every rank or on rank 0 alone, is not a process
    failure: the whole job ends, non-zero, within 90 s, with the error in the log and in the
    failure record (not one rank after another leaving as failed processes)."""
    status, why, out, record = ending(3, f"bug:{who}", tmp_path)
    assert status != 0, out[-3000:]
    assert "ValueError: bug on rank" in out and "aborting the whole job" in out, out[-3000:]
    assert "going on with" not in out, out[-3000:]
    assert record["outcome"] == "failed" and "ValueError: bug on rank" in record["error"], record


@pytest.mark.parametrize("how, status", [("raise", 3), ("exit", 4), ("hook", 1), ("caught", 0)])
def test_survivors_exit_with_the_status_their_program_meant(tmp_path, how, status):
    """Rank 2 of 3 is killed; the survivors finish and end with ``raise SystemExit(3)``,
    ``exit(4)``, an uncaught exception under their own excepthook (1), or a ``sys.exit(5)``
    caught at the top level (0); each leaves through a top-level ``finally``. They end without
    MPI_Finalize (os._exit): the status must still be the program's,
    the record must say completed only for 0, and each survivor's unflushed log line must be
    in its file."""
    got, why, out, record = ending(3, f"survive:{how}", tmp_path)
    assert "going on with 2 ranks" in out, out[-3000:]
    assert got == status, (why, out[-3000:])
    assert record["outcome"] == ("completed" if status == 0 else "failed"), record
    if status == 0:
        assert record["size"] == 2 and record["failures_survived"] == 1, record
    for rank in (0, 1):
        assert (tmp_path / f"log.rank{rank}").read_text() == \
            f"rank {rank} ended training with 2 ranks\n"


def test_the_reset_limit_stops_the_job_with_a_clear_error(tmp_path):
    """reset_limit=1: the first lost rank (rank 0) is survived, the second stops every
    survivor, and the last survivors' rank 0 records why."""
    status, why, out, record = ending(4, "limit", tmp_path)
    assert "going on with 3 ranks" in out, out[-3000:]
    assert status != 0 and out.count("would exceed reset_limit=1") == 2, out[-3000:]
    assert record["outcome"] == "failed" and "reset_limit=1" in record["error"], record


def test_ranks_that_disagree_on_min_np_stop_together(tmp_path):
    status, why, out, record = ending(3, "disagree", tmp_path)
    assert status != 0 and out.count("the ranks disagree on {'min_np': ['1', '2']}") == 3, \
        out[-3000:]
    assert record["outcome"] == "failed", record


def test_a_job_that_starts_below_min_np_stops_with_a_clear_error(tmp_path):
    status, why, out, record = ending(3, "few", tmp_path)
    assert status != 0 and out.count("starts on 3 ranks, fewer than min_np=4") == 3, out[-3000:]
    assert record["outcome"] == "failed", record


def test_an_earlier_jobs_outcome_record_is_removed_when_hvcomm_starts(tmp_path):
    """A record left by an earlier job must not stand for this one, whose ranks all vanish
    after init() without writing one: hvcomm removes it (the verdict is then a failure)."""
    record = tmp_path / "outcome.json"
    outcome.write(record, outcome.COMPLETED, size=3)
    proc = launch.run(3, [ENDINGS, "vanish", str(tmp_path)], timeout=90,
                      env={outcome.ENV: str(record), "HVCOMM_TEST_EXPECT_SIZE": "3"})
    assert not record.exists(), proc.stdout + proc.stderr


def test_below_min_np_every_survivor_stops_with_a_clear_error(tmp_path):
    start = time.monotonic()
    proc = job(3, "none", tmp_path / "a", "--fail", "2:5",
               env={"HVCOMM_ELASTIC_MIN_NP": "3"}, mpi_args=["-x", "HVCOMM_ELASTIC_MIN_NP"])
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert out.count("2 are left, fewer than min_np=3") == 2, out[-3000:]  # both survivors
    assert "OK size" not in out
    assert elapsed < 120, f"took {elapsed:.0f} s"  # within seconds; generous on a busy machine


def test_without_fault_tolerance_a_failure_ends_the_job(tmp_path):
    proc = job(3, "none", tmp_path / "a", "--fail", "2:5", ft=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "OK size" not in out, out[-3000:]
    assert "runs without MPI fault tolerance" in out
    assert json.loads((tmp_path / "a" / "steps.rank2.jsonl").read_text().splitlines()[-1]) \
        ["failed"] == 5  # the job ended because rank 2 died where it was told to


@pytest.mark.skipif(netem.unsupported_reason() is not None,
                    reason=f"no emulated hosts here: {netem.unsupported_reason()}")
def test_killing_every_rank_of_an_emulated_host_is_survived_exactly(tmp_path):
    """2 emulated hosts x 2 ranks at 1 Gbit/s; every rank of the second host is SIGKILLed at
    once (its Open MPI daemon stays: see hvcomm.torch.fault); the 2 ranks of the first host
    finish, and the job ends by itself with status 0. The reference's 4-rank part runs on the
    same emulated hosts (the same summation order); its 2-rank part anywhere (a + b)."""
    def on_cluster(out, *args, ft):
        out.mkdir(parents=True, exist_ok=True)
        cmd = cluster.mpirun_cmd([SCRIPT, "none", str(out), "--commit-every",
                                  str(COMMIT_EVERY), *args], ranks_per_host=2,
                                 fault_tolerant=ft)
        try:
            return subprocess.run(cmd, env=cluster.mpirun_env({"HVCOMM_TEST_EXPECT_SIZE": "4"}),
                                  capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the job did not end in 180 s:\n{e.stdout}\n{e.stderr}"[-6000:])

    out_dir, ref_dir = tmp_path / "a", tmp_path / "reference"
    with netem.EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        proc = on_cluster(out_dir, "--fail", "3:7:host", ft=True)
        left = cluster.processes()
        finished(on_cluster(ref_dir, "--stop-at-commit", str(last_commit_before(7)), ft=False),
                 4)
    finished(proc, 2)
    assert not left, f"processes left on the emulated hosts: {left}"
    seen = sizes_logged(out_dir)
    assert seen[2] == [4] and seen[3] == [4] and seen[0] == seen[1] == [2, 4], seen
    finished(job(2, "none", ref_dir, "--resume", ft=False), 2)
    assert_same_weights(out_dir, torch.load(ref_dir / "final.pt"))


@pytest.mark.parametrize("n, before, after, batches", [(96, 4, 3, 5), (100, 3, 2, 7),
                                                      (10, 4, 3, 1)])
def test_elastic_sampler_after_a_shrink_covers_the_epoch_once(monkeypatch, n, before, after,
                                                              batches):
    """An epoch's samples, some batches on ``before`` ranks, then a shrink to ``after`` ranks
    (the committed sampler state carried over): every sample is seen, and none twice but the
    padding that evens out the last ranks."""
    from hvcomm.torch.elastic import sampler as sampler_module

    def ranks(size, state=None):
        """Each simulated rank's sampler, made (and given ``state``) as that rank."""
        samplers = []
        for r in range(size):
            monkeypatch.setattr(sampler_module, "size", lambda: size)
            monkeypatch.setattr(sampler_module, "rank", lambda r=r: r)
            s = sampler_module.ElasticSampler(list(range(n)), shuffle=True, seed=5)
            s.set_epoch(2)
            if state is not None:
                s.load_state_dict(state)
            samplers.append(s)
        return samplers

    batch = 2
    seen = []
    first = ranks(before)
    for s in first:
        seen += list(s)[:batches * batch]
    for _ in range(batches):
        for s in first:
            s.record_batch(0, batch)
    state = first[0].state_dict()
    assert state["processed_num"] == batches * batch * before
    later = ranks(after, state)
    for s in later:
        seen += list(s)
    assert sorted(set(seen)) == list(range(n))
    padding = len(later[0]) * after - (n - state["processed_num"])
    assert len(seen) == n + padding and 0 <= padding < after


def test_restore_brings_back_the_commit_every_time(tmp_path):
    """One process (no mpirun): commit, train, restore, train, restore: the model and the
    optimizer's momentum are the committed ones both times (a restore must not hand the
    commit's own tensors to the optimizer, which training would then change)."""
    script = tmp_path / "restore.py"
    script.write_text('''
import torch
import hvcomm.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, batch=0)
x = torch.randn(8, 4)

def train():
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()
    state.batch += 1

train()
state.commit()
weights = {k: v.clone() for k, v in model.state_dict().items()}
momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
for _ in range(2):
    train()
    train()
    state.restore()
    assert state.batch == 1
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum))
print("OK")
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=launch.mpi_env())
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(netem.unsupported_reason() is not None,
                    reason=f"no emulated hosts here: {netem.unsupported_reason()}")
def test_a_lost_daemon_ends_the_job_and_the_verdict_is_a_failure(tmp_path):
    """2 emulated hosts x 1 rank; the second host's rank kills its parent, Open MPI's daemon
    there, then itself (a node crash, as far as Open MPI can tell). mpirun ends the job, which
    never recorded its completion: whatever mpirun's exit status, the verdict is a failure,
    within 90 s."""
    record = tmp_path / "outcome.json"
    env = {outcome.ENV: str(record)}
    with netem.EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        cmd = cluster.mpirun_cmd([SCRIPT, "none", str(tmp_path), "--fail", "1:7:daemon"],
                                 fault_tolerant=True, env=env)
        try:
            proc = subprocess.run(cmd, env=cluster.mpirun_env(env), capture_output=True,
                                  text=True, timeout=90)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the job did not end in 90 s:\n{e.stdout}\n{e.stderr}"[-6000:])
    out = proc.stdout + proc.stderr
    status, why = outcome.verdict(record, proc.returncode)
    assert status != 0 and "OK size" not in out, (why, out[-3000:])
    assert json.loads((tmp_path / "steps.rank1.jsonl").read_text().splitlines()[-1]) \
        ["failed"] == 7, out[-3000:]  # the job ended because the daemon died where told to
