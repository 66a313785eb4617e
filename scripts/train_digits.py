"""Data-parallel training of an MLP on scikit-learn's handwritten digits, one method per run.

Run under MPI (scripts/main_job.py does this for every method):
    mpirun -n 4 python -m mpi4py scripts/train_digits.py --method hvcomm-dense --out r.json
"""
from __future__ import annotations

import argparse
import copy
import json
import time

from mpi4py import MPI  # noqa: F401 - before Horovod, which then shares its communicator
import numpy as np
import torch
from sklearn.datasets import load_digits

import hvcomm.torch as hvc
import report

HIDDEN = 512


def horovod_module():
    import horovod.torch as horovod
    if not horovod.is_initialized():
        horovod.init(comm=MPI.COMM_WORLD)
    return horovod


def dense_bytes(model) -> float:
    n = hvc.size()
    return 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in model.parameters())


DELAY_WARMUP = {"steps": 100}  # --delay-warmup


def hvcomm_method(compression=None, delay=None):
    def build(opt, model):
        d = None if delay is None else hvc.Delay(**{**delay, "warmup_steps": DELAY_WARMUP["steps"]})
        return hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=compression or hvc.Compression.none,
                                        delay=d)
    return build, lambda opt, model: opt.comm_stats.sent_bytes


def horovod_dense():
    def build(opt, model):
        return horovod_module().DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return build, lambda opt, model: dense_bytes(model)  # Horovod reports none: ring model


C = hvc.Compression
# name -> (builder(optimizer, model) -> distributed optimizer, bytes sent per step per rank)
METHODS = {
    "hvcomm-dense": hvcomm_method(),
    "horovod-dense": horovod_dense(),
    "hvcomm-fp16": hvcomm_method(C.fp16),
    "topk-0.01": hvcomm_method(C.topk(0.01, scope="model")),
    "topk-0.001": hvcomm_method(C.topk(0.001, scope="model")),
    "gtopk-0.01": hvcomm_method(C.gtopk(0.01, scope="model")),
    "gtopk-0.001": hvcomm_method(C.gtopk(0.001, scope="model")),
    "gtopk-0.001-layerwise": hvcomm_method(C.gtopk(0.001, scope="layer")),
    "gtopk-0.001-warmup": hvcomm_method(C.gtopk(0.001, scope="model", warmup_steps=200)),
    # random-k is not in the main job's default set: see scripts/main_job.py, results/randomk.md
    "randomk-0.01": hvcomm_method(C.randomk(0.01, scope="model")),
    "randomk-0.01-ef": hvcomm_method(C.randomk(0.01, scope="model", variant="error_feedback")),
    "randomk-0.1": hvcomm_method(C.randomk(0.1, scope="model")),
    "randomk-0.1-ef": hvcomm_method(C.randomk(0.1, scope="model", variant="error_feedback")),
    "randomk-1.0": hvcomm_method(C.randomk(1.0, scope="model")),
    "twobit-0.5": hvcomm_method(C.twobit(0.5)),
    "powersgd-4": hvcomm_method(C.powersgd(rank=4)),
    # delayed synchronisation: --delay-warmup synchronous steps first, local learning rate
    # 4x the global one (as SSD-SGD's runs), k = 5 as the originals
    "od-sgd": hvcomm_method(delay=dict(mode="od-sgd", local_lr=0.2)),
    "ssd-sgd": hvcomm_method(delay=dict(mode="ssd-sgd", local_lr=0.2, k=5)),
    "cd-sgd": hvcomm_method(C.twobit(0.5), delay=dict(mode="cd-sgd", local_lr=0.2, k=5)),
}


def load_data(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    return (x[perm[n_test:]], y[perm[n_test:]]), (x[perm[:n_test]], y[perm[:n_test]])


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=sorted(METHODS), default="hvcomm-dense")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay-warmup", type=int, default=100,
                    help="synchronous steps before od/ssd/cd-sgd start delaying")
    ap.add_argument("--out", help="write the results of rank 0 as JSON here")
    args = ap.parse_args()
    DELAY_WARMUP["steps"] = args.delay_warmup

    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    hosts = MPI.COMM_WORLD.gather(MPI.Get_processor_name())
    if rank == 0:
        print(f"[{args.method}] world size {size} on {len(set(hosts))} hosts: "
              f"{', '.join(sorted(set(hosts)))}", flush=True)
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    model = make_model(args.seed)
    build, bytes_of = METHODS[args.method]
    opt = build(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model)
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    per_rank = len(xtr) // size
    steps = per_rank // args.batch
    history, train_time, samples, sent = [], 0.0, 0, []
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(1000 + epoch))
        mine = order[rank::size][:per_rank]
        model.train()
        t0, total_loss = time.perf_counter(), 0.0
        for s in range(steps):
            idx = mine[s * args.batch:(s + 1) * args.batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total_loss += loss.item()
            sent.append(bytes_of(opt, model))
        train_time += MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        samples += steps * args.batch * size
        evaluated = model
        if getattr(opt, "delay", None) is not None:  # delayed: test the global weights
            evaluated = copy.deepcopy(model)
            evaluated.load_state_dict(opt.global_weights(), strict=False)
        evaluated.eval()
        with torch.no_grad():
            acc = (evaluated(xte).argmax(1) == yte).float().mean().item()
        loss_avg = MPI.COMM_WORLD.allreduce(total_loss / steps) / size
        history.append({"epoch": epoch + 1, "train_loss": loss_avg, "test_acc": acc})
        if rank == 0:
            print(f"[{args.method}] epoch {epoch + 1:3d}/{args.epochs}  loss {loss_avg:.4f}  "
                  f"test acc {acc:.4f}  ({train_time:.1f} s)", flush=True)
    digests = MPI.COMM_WORLD.allgather(report.weights_digest(evaluated.named_parameters()))
    digest = digests[0] if len(set(digests)) == 1 else "ranks differ"
    if rank == 0:
        print(f"[{args.method}] final test acc {history[-1]['test_acc']:.4f}, "
              f"throughput {samples / train_time:.0f} samples/s, train time {train_time:.1f} s",
              flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "ranks": size, "epochs": args.epochs,
                       "delay_warmup_steps": args.delay_warmup, "lr": args.lr,
                       "batch_per_rank": args.batch, "history": history,
                       "throughput": samples / train_time, "train_time_s": train_time,
                       "bytes_per_iter_per_rank": float(np.mean(sent)),
                       "params": sum(p.numel() for p in model.parameters()),
                       "final_test_acc": history[-1]["test_acc"],
                       "final_weights_sha256": digest}, f)


if __name__ == "__main__":
    main()
