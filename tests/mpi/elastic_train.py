"""An elastic training job written as for Horovod's elastic mode (ElasticSampler, TorchState,
``@hvd.elastic.run``, a reset callback that rescales the learning rate), with failures on
schedule: the script behind tests/test_elastic.py and scripts/bench_elastic.py.

    elastic_train.py METHOD OUT [--epochs E] [--commit-every C]
                     [--fail RANK:STEP[:how] ...] [--stop-at-commit S] [--resume]

``--fail 3:7`` ends world rank 3 right after the backward pass of global step 7, while the
others wait for its gradients; ``how``: kill (SIGKILL, the default), host (SIGKILL to every
rank on its node, itself last), daemon (SIGKILL to its parent, Open MPI's daemon on that
node, then itself: a node crash), raise (an exception escapes), reset (SIGKILL in its reset
callback, during the recovery from another failure; STEP is not used), after (SIGKILL after
the step's ``opt.step()``, its gradients sent), commit (SIGKILL inside the commit after the
step, once this rank has saved it, before the commit's collective check).
``--stop-at-commit S`` saves each rank's committed state to OUT/commit.rank<R>.pt at the
commit after step S and ends (``--stop-at-commit-id C``: after the commit numbered C);
``--resume`` starts from those files instead of from scratch (rank R reads rank R's): the two
make the reference for a failure, trained on the old size up to the commit and on the new size
from it. Each rank logs every completed step to OUT/steps.rank<R>.jsonl (step, time, size);
each saved commit ("saved": its step, "commit": its number), and each restore ("restored": the
step); rank 0 writes the final weights to OUT/final.pt and prints "OK size=N steps=S".
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train_resumable import METHODS  # noqa: E402
from training import Net, loss_fn, make_opt  # noqa: E402

import hvcomm.torch as hvd  # noqa: E402

BATCH, SAMPLES, LR = 4, 192, 0.05
WORLD_RANK = MPI.COMM_WORLD.Get_rank()


def dataset():
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 10, generator=g),
                                          torch.randint(0, 3, (SAMPLES,), generator=g))


def parse_failures(specs):
    """{(step, world rank): how}, and the world ranks that die in their reset callback."""
    plan, in_reset = {}, set()
    for spec in specs:
        rank, step, *how = spec.split(":")
        how = how[0] if how else "kill"
        if how == "reset":
            in_reset.add(int(rank))
        else:
            plan[int(step), int(rank)] = how
    return plan, in_reset


def fail(how: str, node_pids) -> None:
    sys.stdout.flush()
    if how == "raise":
        raise RuntimeError(f"rank {WORLD_RANK} fails on purpose")
    if how == "host":
        for pid in node_pids:
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
    if how == "daemon":
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=sorted(METHODS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--commit-every", type=int, default=3)
    ap.add_argument("--fail", nargs="*", default=[])
    ap.add_argument("--stop-at-commit", type=int, default=None)
    ap.add_argument("--stop-at-commit-id", type=int, default=None,
                    help="end after the commit numbered this (state.commit_id)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (no value changes)")
    a = ap.parse_args()
    failures, die_in_reset = parse_failures(a.fail)
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    node_pids = node.allgather(os.getpid())
    node.Free()

    hvd.init()
    expect = os.environ.get("HVCOMM_TEST_EXPECT_SIZE")
    if expect and int(expect) != hvd.size():
        raise SystemExit(f"expected {expect} ranks, mpirun started {hvd.size()}")
    model = Net(width=24)
    kw = dict(METHODS[a.method])
    if a.method == "p3":
        kw["model"] = model
    base = make_opt(model)
    for group in base.param_groups:
        group["lr"] = LR * hvd.size()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kw)
    data = dataset()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    if a.resume:
        saved = torch.load(a.out / f"commit.rank{hvd.rank()}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sampler.load_state_dict(saved["sampler"])
        state.epoch, state.step = saved["epoch"], saved["step"]
        state.save()

    def rescale():
        for group in opt.param_groups:
            group["lr"] = LR * hvd.size()

    def on_reset():
        if WORLD_RANK in die_in_reset:
            fail("kill", node_pids)
        log.write(json.dumps({"restored": state.step, "time": time.time()}) + "\n")
        rescale()
    state.register_reset_callbacks([on_reset])
    rescale()  # (a resumed optimizer has the learning rate of the size it was saved at)
    log = open(a.out / f"steps.rank{WORLD_RANK}.jsonl", "a")
    save_commit = state.save_commit

    def save_commit_and_log():  # what this rank has saved (and to disk, when asked): the
        save_commit()           # tests' expectation of the commit the survivors restore
        log.write(json.dumps({"saved": state.step, "commit": state.commit_id}) + "\n")
        log.flush()
    state.save_commit = save_commit_and_log

    def stop_here(every_c_steps: bool = True) -> bool:
        """After a commit (every C steps, or at an epoch's end): at --stop-at-commit's step or
        --stop-at-commit-id's commit, save this rank's committed state for --resume; stop."""
        at_step = every_c_steps and a.stop_at_commit is not None and state.step >= a.stop_at_commit
        at_id = a.stop_at_commit_id is not None and state.commit_id >= a.stop_at_commit_id
        if not (at_step or at_id):
            return False
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(), "epoch": state.epoch, "step": state.step},
                   a.out / f"commit.rank{hvd.rank()}.pt")
        return True

    @hvd.elastic.run
    def train(state):
        print(f"training from step {state.step} on {hvd.size()} ranks", flush=True)
        while state.epoch < a.epochs:
            for batch_idx, (x, y) in enumerate(loader):
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                how = failures.get((state.step, WORLD_RANK))
                if how is not None:
                    log.write(json.dumps({"failed": state.step, "time": time.time()}) + "\n")
                    log.flush()
                    if how not in ("after", "commit"):
                        fail(how, node_pids)
                opt.step()
                if how == "after":
                    fail("kill", node_pids)
                state.step += 1
                sampler.record_batch(batch_idx, BATCH)
                log.write(json.dumps({"step": state.step, "time": time.time(),
                                      "size": hvd.size()}) + "\n")
                log.flush()
                time.sleep(a.sleep)
                if state.step % a.commit_every == 0:
                    if how == "commit":  # what commit() does, up to its collective
                        state.save_commit()
                        fail("kill", node_pids)
                    state.commit()
                    if stop_here():
                        return False
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if stop_here(every_c_steps=False):
                return False
        return True

    finished = train(state)
    if finished:
        opt.finish_pending()  # P3's deferred update, the delayed methods' last average
    if hvd.rank() == 0:
        if finished:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, a.out / "final.pt")
        print(f"OK size={hvd.size()} steps={state.step}", flush=True)


if __name__ == "__main__":
    main()
