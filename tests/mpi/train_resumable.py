"""Training that checkpoints every step and can resume: the script behind the kill -9 test.

    train_resumable.py METHOD DIR STEPS [--resume] [--slow-after K]

Every rank writes its own checkpoint after every step (model, optimizer with hvcomm's state:
residuals, delayed weights, P3's deferred updates applied) with hvcomm.torch.checkpoint.save:
DIR/step<S>.rank<R>.pt, written to a temporary name and renamed, so a rank killed mid-write
leaves the previous one intact. ``--resume`` restarts from checkpoint.newest_common: the newest
step that every rank has finished saving (None when some rank has none). At the end each rank
saves its weights to DIR/final.rank<R>.pt. ``--slow-after K`` sleeps 0.3 s after every step
past K, to leave a killer time to strike mid-training; the sleep changes no value.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import Checks  # noqa: E402
from training import Net, data, loss_fn, make_opt, shard  # noqa: E402

import hvcomm.torch as hvd  # noqa: E402
from hvcomm.torch import checkpoint  # noqa: E402

C = hvd.Compression
METHODS = {  # every synchronisation hvcomm offers, small enough for a few steps on 3 ranks
    "none": {},
    "fp16": dict(compression=C.fp16),
    "topk": dict(compression=C.topk(0.1)),
    "gtopk": dict(compression=C.gtopk(0.1)),
    "randomk": dict(compression=C.randomk(0.1)),
    "twobit": dict(compression=C.twobit(0.01)),
    "powersgd": dict(compression=C.powersgd(rank=2)),
    "wfbp": dict(schedule="wfbp"),
    "od-sgd": dict(delay=hvd.Delay("od-sgd", warmup_steps=2)),
    "ssd-sgd": dict(delay=hvd.Delay("ssd-sgd", warmup_steps=2, k=3)),
    "cd-sgd": dict(delay=hvd.Delay("cd-sgd", warmup_steps=2, k=3), compression=C.twobit(0.01)),
    "p3": dict(schedule="p3", slice_elems=100),
}


def build(method: str):
    """A fresh model (same initial weights everywhere) and its DistributedOptimizer."""
    model = Net(width=24)
    kw = dict(METHODS[method])
    if method == "p3":
        kw["model"] = model
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   **kw)
    return model, opt


def train_step(model, opt, step: int) -> None:
    r = hvd.rank()
    x, y = data(step, hvd.size())
    opt.zero_grad()
    loss_fn(model, shard(x, r), shard(y, r)).backward()
    opt.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=sorted(METHODS))
    ap.add_argument("dir", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--slow-after", type=int, default=None)
    a = ap.parse_args()
    hvd.init()
    Checks()  # the size check: N unconnected one-rank jobs must not pass
    r = hvd.rank()
    model, opt = build(a.method)
    start = 0
    if a.resume:
        common = checkpoint.newest_common(a.dir)
        if common is not None:
            ckpt = checkpoint.load(a.dir, common)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            start = common + 1
        if r == 0:
            print(f"resuming after step {-1 if common is None else common}", flush=True)
    (a.dir / f"pid.rank{r}").write_text(str(os.getpid()))
    for s in range(start, a.steps):
        train_step(model, opt, s)
        checkpoint.save(a.dir, s, {"optimizer": opt.state_dict(), "model": model.state_dict()})
        if a.slow_after is not None and s >= a.slow_after:
            time.sleep(0.3)
    opt.finish_pending()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               a.dir / f"final.rank{r}.pt")
    if r == 0:
        print(f"OK size={hvd.size()} trained to step {a.steps}", flush=True)


if __name__ == "__main__":
    main()
