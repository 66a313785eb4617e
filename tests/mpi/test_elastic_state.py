"""Elastic state after a failure, without killing anything (run at 3 ranks): the survivors
restore the newest commit they all have, and sync() gives every rank rank 0's hvcomm state
but its own residuals. The ranks' commits are made unequal on purpose, as a collective that
completed on some ranks and failed on others would leave them."""
import pytest
import torch
from mpi4py import MPI

import hvcomm.torch as hvd
from collectives.errors import HvcommError
from hvcomm.torch.elastic import _restore_agreed_commit

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture(autouse=True)
def started():
    hvd.init()
    yield


def make_state(compression=hvd.Compression.none, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, **kw)
    return model, opt, hvd.elastic.TorchState(model, opt, epoch=0)


def commit_without_collective(state, model, value):
    """What commit() does on a rank, less its collective check for host changes: the state
    numbered value, weights and epoch equal to value."""
    with torch.no_grad():
        model.weight.fill_(value)
    state.epoch = value
    state.save_commit()
    assert state.commit_id == value


def test_the_survivors_restore_the_newest_commit_they_all_have():
    model, opt, state = make_state()
    made = [3, 2, 3][:SIZE] if SIZE > 1 else [3]
    for value in range(1, made[RANK] + 1):
        commit_without_collective(state, model, value)
    with torch.no_grad():
        model.weight.fill_(-7.0)  # the steps after the commits, lost with the failure
    state.epoch = -7
    _restore_agreed_commit(state)
    expected = min(made)
    assert state.commit_id == expected and state.epoch == expected
    assert torch.equal(model.weight, torch.full((5, 6), float(expected)))
    commit_without_collective(state, model, expected + 1)  # numbering goes on from there
    state.restore()
    assert state.epoch == expected + 1


def test_a_commit_no_longer_kept_stops_every_rank():
    if SIZE < 2:
        pytest.skip("needs two ranks one commit apart")
    model, opt, state = make_state()
    for value in range(1, (1 if RANK == 1 else 4) + 1):  # 1 commit on rank 1, 4 elsewhere
        commit_without_collective(state, model, value)
    with pytest.raises(HvcommError, match=r"keep no commit in common"):
        _restore_agreed_commit(state)


def test_a_commit_saved_in_part_is_not_restored():
    """A failure inside a commit's save (the optimizer's state_dict waits for a collective)
    leaves that commit in part: every rank restores the one before."""
    model, opt, state = make_state()
    for value in (1, 2):
        commit_without_collective(state, model, value)
    if RANK == 0:  # commit 3 saved in part: the model's copy only
        state.commit_id += 1
        state._handlers["model"].save(state.commit_id)
    _restore_agreed_commit(state)
    assert state.commit_id == 2 and state.epoch == 2
    assert torch.equal(model.weight, torch.full((5, 6), 2.0))


def test_sync_gives_every_rank_rank_0s_hvcomm_state_and_keeps_its_residuals():
    """PowerSGD at rank 1 (Q factors global, residuals per rank), two steps on each rank's own
    data; then every rank but 0 has its step counter and Q factors overwritten. sync() must
    bring back rank 0's step and Q, and leave each rank's residuals as they were."""
    model, opt, state = make_state(hvd.Compression.powersgd(rank=1))
    g = torch.Generator().manual_seed(RANK)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
        opt.step()
    before = opt.state_dict()["hvcomm"]
    rank0 = MPI.COMM_WORLD.bcast(before if RANK == 0 else None, root=0)
    if RANK > 0:
        spoiled = opt.state_dict()
        spoiled["hvcomm"]["step"] = 99
        spoiled["hvcomm"]["compressor"]["q"] = {k: torch.randn_like(q) for k, q in
                                                spoiled["hvcomm"]["compressor"]["q"].items()}
        opt.load_state_dict(spoiled)
    state.sync()
    after = opt.state_dict()["hvcomm"]
    assert after["step"] == rank0["step"] == 2
    assert after["compressor"]["q"].keys() == rank0["compressor"]["q"].keys()
    for k, q in rank0["compressor"]["q"].items():
        assert torch.equal(after["compressor"]["q"][k], q), k
    mine = before["residuals_by_param"]
    assert after["residuals_by_param"].keys() == mine.keys() and mine
    for k, r in mine.items():
        assert torch.equal(after["residuals_by_param"][k], r), k
    residual_sums = MPI.COMM_WORLD.allgather(float(sum(r.abs().sum() for r in mine.values())))
    assert SIZE == 1 or len(set(residual_sums)) == SIZE  # the residuals really are per rank


def test_sync_under_diloco_gives_every_rank_rank_0s_model_and_global_state():
    """DiLoCo, period 2, two fragments: four steps on each rank's own data leave different
    local weights; an exchange in flight (overlap_steps=1). sync() must give every rank rank
    0's local weights, global weights, outer momentum and the exchange waited for."""
    model, opt, state = make_state(delay=hvd.DiLoCo(period=2, fragments=2, overlap_steps=1,
                                                    outer_lr=0.5, outer_momentum=0.5))
    g = torch.Generator().manual_seed(RANK)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
        opt.step()
    rank0 = MPI.COMM_WORLD.bcast((opt.state_dict()["hvcomm"], model.state_dict())
                                 if RANK == 0 else None, root=0)
    mine = [p.detach().clone() for p in model.parameters()]
    different = MPI.COMM_WORLD.allgather(float(sum(p.sum() for p in mine)))
    assert SIZE == 1 or len(set(different)) == SIZE  # the local weights really are per rank
    if RANK > 0:  # what sync() must bring back from rank 0
        spoiled = opt.state_dict()
        ours = spoiled["hvcomm"]["periodic"]
        for part in ("W", "outer_momentum"):
            ours[part] = {k: v + 1 for k, v in ours[part].items()}
        ours["averaged"] = []
        opt.load_state_dict(spoiled)
    state.sync()
    after, weights = opt.state_dict()["hvcomm"], model.state_dict()
    for k, v in rank0[1].items():
        assert torch.equal(weights[k], v), k
    ours, theirs = after["periodic"], rank0[0]["periodic"]
    assert ours["W"].keys() == theirs["W"].keys() and ours["outer_momentum"]
    for part in ("W", "outer_momentum"):
        for k, v in theirs[part].items():
            assert torch.equal(ours[part][k], v), (part, k)
    assert [(due, f, sorted(a)) for due, f, a in ours["averaged"]] == \
        [(due, f, sorted(a)) for due, f, a in theirs["averaged"]] and ours["averaged"]
    for (_, _, mine_now), (_, _, want) in zip(ours["averaged"], theirs["averaged"]):
        for k, v in want.items():
            assert torch.equal(mine_now[k], v), k


@pytest.fixture
def on_disk(monkeypatch):
    """Elastic state to disk at every commit, in a directory every rank shares."""
    import tempfile
    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="hvcomm-elastic-")
                                     if RANK == 0 else None)
    monkeypatch.setenv("HVCOMM_ELASTIC_SAVE_EVERY", "1")
    monkeypatch.setenv("HVCOMM_CHECKPOINT_DIR", directory)
    yield directory
    MPI.COMM_WORLD.barrier()


def test_a_relaunched_job_resumes_from_the_newest_commit_every_rank_saved(on_disk):
    """Commits 1-3 on disk (rank 1 only up to 2, as if it died saving 3); a new job (a fresh
    model and optimizer) starts from commit 2 on every rank: weights, epoch, numbering."""
    model, opt, state = make_state()
    for value in range(1, (2 if RANK == 1 else 3) + 1):
        commit_without_collective(state, model, value)  # (saved to disk too)
    model, opt, state = make_state()
    assert state.resume_from_disk() == (2 if SIZE > 1 else 3)
    expected = 2 if SIZE > 1 else 3
    assert state.commit_id == expected and state.epoch == expected
    assert torch.equal(model.weight, torch.full((5, 6), float(expected)))


def test_another_jobs_state_on_disk_is_refused(on_disk):
    model, opt, state = make_state()
    commit_without_collective(state, model, 1)
    torch.manual_seed(0)
    other = hvd.elastic.TorchState(torch.nn.Linear(6, 5), step=0)  # no optimizer, no epoch
    with pytest.raises(HvcommError, match="another job's state"):
        other.resume_from_disk()


def test_a_job_on_more_ranks_than_saved_the_state_refuses_it(on_disk, monkeypatch):
    """Commit 1 saved by a job of one rank fewer (every rank but the last): every rank
    raises, none starts afresh."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    import hvcomm.torch.elastic.state as state_module
    model, opt, state = make_state()
    if RANK < SIZE - 1:
        with monkeypatch.context() as smaller_job:
            smaller_job.setattr(state_module, "size", lambda: SIZE - 1)
            commit_without_collective(state, model, 1)
    model, opt, state = make_state()
    with pytest.raises(HvcommError, match=rf"saved by \[{SIZE - 1}\] ranks and this job has "
                                          rf"{SIZE}"):
        state.resume_from_disk()


def test_a_first_save_cut_short_starts_afresh(on_disk):
    """Commit 1 saved by this job's ranks but the last (killed before its save): no commit
    every rank has, so the job starts from the beginning."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    model, opt, state = make_state()
    if RANK < SIZE - 1:
        commit_without_collective(state, model, 1)
    model, opt, state = make_state()
    assert state.resume_from_disk() is None
    assert state.commit_id == 0 and state.epoch == 0
