"""Data-parallel training of one of the main job's workloads (scripts/workloads.py: the digits
MLP, a 1-D CNN on MNIST-1D, a character transformer) with one method, or with several of one
framework in turn (``--methods``: each from the same seed, the one before finished and
released first; scripts/main_job.py runs each framework's methods so).

Run under MPI:
    mpirun -n 4 python -m mpi4py scripts/train.py --workload cnn --method hvcomm-dense --out r.json

With ``--checkpoint-dir DIR`` (the batch scripts of slurm/ pass HVCOMM_CHECKPOINT_DIR, which is
its default) the run can be stopped and resumed exactly: on SIGUSR1 or SIGTERM to any rank,
every rank saves a checkpoint at the next step boundary (hvcomm.torch.preemption,
hvcomm.torch.checkpoint), rank 0 then writes DIR/preempted.json, and the run exits 0; started
again with the same DIR and world size, it resumes from that checkpoint and ends with bitwise
the weights of an uninterrupted run.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from mpi4py import MPI  # noqa: F401 - before Horovod, which then shares its communicator
import numpy as np
import torch

import hvcomm.torch as hvc
from hvcomm import durable
from hvcomm.torch import checkpoint, preemption
import ddp_peer
import report
from workloads import WORKLOADS


def horovod_module():
    import horovod.torch as horovod
    if not horovod.is_initialized():
        horovod.init(comm=MPI.COMM_WORLD)
    return horovod


def dense_bytes(model) -> float:
    n = hvc.size()
    return 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in model.parameters())


DELAY_WARMUP = {"steps": 100}  # --delay-warmup
PERIOD = 8  # local SGD's and DiLoCo's (hvcomm's and DDP's post-local SGD)
LOCAL_LR = 4  # the delayed methods' local learning rate, times the job's (as SSD-SGD's runs)


def hvcomm_method(compression=None, delay=None):
    """``delay``: the settings class of delay= and its keyword arguments but the warm-up (and,
    for a Delay, the local learning rate)."""
    def build(opt, model):
        kw = dict(delay[1]) if delay else {}
        if delay and delay[0] is hvc.Delay:
            kw["local_lr"] = LOCAL_LR * opt.param_groups[0]["lr"]
        d = None if delay is None else delay[0](**kw, warmup_steps=DELAY_WARMUP["steps"])
        return model, hvc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression or hvc.Compression.none,
                                               delay=d)
    build.fixed_local_lr = bool(delay) and delay[0] is hvc.Delay
    return build, lambda opt, model: opt.comm_stats.sent_bytes


def horovod_dense():
    def build(opt, model):
        return model, horovod_module().DistributedOptimizer(
            opt, named_parameters=model.named_parameters())
    build.fixed_local_lr = False
    return build, lambda opt, model: dense_bytes(model)  # Horovod reports none: ring model


def ddp_method(method: str):
    """PyTorch DDP (gloo) as scripts/ddp_peer.py sets it up; bytes: the ring model."""
    def build(opt, model):
        if not torch.distributed.is_initialized():
            ddp_peer.init_gloo(MPI.COMM_WORLD)
        if method == ddp_peer.POST_LOCAL_SGD:
            warmup = DELAY_WARMUP["steps"]
            return (ddp_peer.wrap(model, method, warmup_steps=warmup),
                    ddp_peer.local_sgd(opt, PERIOD, warmup))
        return ddp_peer.wrap(model, method), opt
    build.fixed_local_lr = False

    def bytes_of(opt, model):
        if method == ddp_peer.POST_LOCAL_SGD and not ddp_peer.local_sgd_communicated(
                opt.averager.step - 1, PERIOD, DELAY_WARMUP["steps"]):
            return 0.0
        dense = "dense" if method == ddp_peer.POST_LOCAL_SGD else method
        return ddp_peer.ring_bytes(ddp_peer.payload_bytes(model.parameters(), dense),
                                   hvc.size())
    return build, bytes_of


C = hvc.Compression
# name -> (builder(optimizer, model) -> (model to train, optimizer to step), bytes sent per
# step per rank); builder.fixed_local_lr: whether the method steps locally at LOCAL_LR times the
# job's learning rate, whatever its schedule
METHODS = {
    "hvcomm-dense": hvcomm_method(),
    "horovod-dense": horovod_dense(),
    "ddp-dense": ddp_method("dense"),
    "ddp-fp16": ddp_method("fp16"),
    "ddp-powersgd-4": ddp_method("powersgd"),
    f"ddp-post-local-sgd-{PERIOD}": ddp_method(ddp_peer.POST_LOCAL_SGD),
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
    # LOCAL_LR times the job's, k = 5 as the originals
    "od-sgd": hvcomm_method(delay=(hvc.Delay, dict(mode="od-sgd"))),
    "ssd-sgd": hvcomm_method(delay=(hvc.Delay, dict(mode="ssd-sgd", k=5))),
    "cd-sgd": hvcomm_method(C.twobit(0.5), delay=(hvc.Delay, dict(mode="cd-sgd", k=5))),
    # periodic averaging after the same --delay-warmup synchronous steps, every PERIOD steps.
    # DiLoCo's outer momentum 0.5, not its paper's 0.9 (whose inner optimizer is AdamW, H 500):
    # with the inner SGD's momentum 0.9 the two compound (the digits, 8 epochs at 4 ranks: test
    # accuracy 0.933 with 0.9, 0.978 with 0.5; local SGD 0.981)
    f"local-sgd-{PERIOD}": hvcomm_method(delay=(hvc.LocalSGD, dict(period=PERIOD))),
    f"diloco-{PERIOD}": hvcomm_method(delay=(hvc.DiLoCo, dict(period=PERIOD,
                                                              outer_momentum=0.5))),
}


def framework(method: str) -> str:
    """Whose method it is: "ddp", "horovod" or "hvcomm" (several methods share a process only
    within one framework: Horovod's background thread, for one, never stops)."""
    return next((f for f in ("ddp", "horovod") if method.startswith(f + "-")), "hvcomm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--method", choices=sorted(METHODS), default="hvcomm-dense")
    which.add_argument("--methods", nargs="+", choices=sorted(METHODS), metavar="METHOD",
                       help="train these in turn in this one process (all of one framework: "
                            "hvcomm's, DDP's or Horovod's), each from the same seed; --out "
                            "then holds a list, one result per method")
    ap.add_argument("--epochs", type=int, help="default: the workload's")
    ap.add_argument("--batch", type=int, help="per rank (default: the workload's)")
    ap.add_argument("--lr", type=float,
                    help="default: the workload's (the CNN's annealed by a cosine over the "
                         "epochs; the delayed methods' local lr stays 4x this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay-warmup", type=int,
                    help="synchronous steps before the delayed and periodic methods start "
                         "(default: the workload's)")
    ap.add_argument("--out", help="write the results of rank 0 as JSON here")
    ap.add_argument("--checkpoint-dir", default=os.environ.get("HVCOMM_CHECKPOINT_DIR") or None,
                    help="on SIGUSR1/SIGTERM checkpoint here and exit 0; resume from here "
                         "(default: $HVCOMM_CHECKPOINT_DIR, which the batch scripts set; "
                         "unset: no checkpoints, the signals end the run)")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="with --checkpoint-dir, also checkpoint every N steps (keeping the two "
                         "newest): what a run killed before it could checkpoint resumes from")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="sleep this long after every step (changes no value: to give a "
                         "signal time to arrive mid-training in tests)")
    args = ap.parse_args()
    work = WORKLOADS[args.workload]
    args.epochs = work.epochs if args.epochs is None else args.epochs
    args.lr = work.lr if args.lr is None else args.lr
    args.batch = work.batch if args.batch is None else args.batch
    if args.delay_warmup is None:
        args.delay_warmup = work.warmup_steps
    DELAY_WARMUP["steps"] = args.delay_warmup
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.checkpoint_every and ckpt_dir is None:
        ap.error("--checkpoint-every needs --checkpoint-dir (or HVCOMM_CHECKPOINT_DIR)")
    methods = args.methods or [args.method]
    if args.methods and ckpt_dir is not None:
        ap.error("--checkpoint-dir resumes one method's run: give --method, not --methods")
    frameworks = sorted({framework(m) for m in methods})
    if len(frameworks) > 1:
        ap.error(f"--methods {' '.join(methods)} mixes frameworks ({', '.join(frameworks)}): "
                 "run each framework's methods in their own process")
    fixed = [m for m in methods if METHODS[m][0].fixed_local_lr]
    if work.cosine and fixed:
        ap.error(f"{', '.join(fixed)} step(s) locally at a fixed learning rate ({LOCAL_LR}x the "
                 f"job's), which the {work.name} workload's cosine schedule would leave "
                 "undecayed: run them on a workload with a constant learning rate (digits)")
    if ckpt_dir is not None:
        # first thing: a signal before this ends the process (the batch scripts forward
        # SIGUSR1 only once rank 0 has written DIR/listening, below)
        preemption.install()

    hvc.init()
    rank, size = hvc.rank(), hvc.size()
    hosts = MPI.COMM_WORLD.gather(MPI.Get_processor_name())
    if rank == 0:
        print(f"[{', '.join(methods)}] world size {size} on {len(set(hosts))} hosts: "
              f"{', '.join(sorted(set(hosts)))}", flush=True)
    if ckpt_dir is not None and rank == 0:
        # every rank has installed its handlers (before the gather): a signal is safe now; the
        # batch scripts forward SIGUSR1 only once this file is there
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / "listening").write_text(f"{size} ranks\n")
    # one rank makes the data (the same on every rank), leaving the others' cores to it
    data = MPI.COMM_WORLD.bcast(work.load(args.seed) if rank == 0 else None)
    # MPI's TCP transport connects a pair of ranks at its first message: connect every pair
    # now, so that no method's timed steps pay for it (gloo connects at its init)
    MPI.COMM_WORLD.alltoall([None] * size)
    results = []
    for method in methods:
        run = copy.copy(args)
        run.method = method
        results.append(train(run, work, data, ckpt_dir))
        if results[-1] is None:  # stopped by a signal, its checkpoint written
            return
        gc.collect()  # the method's model and optimizer (cycles through their hooks) freed now
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results if args.methods else results[0], f)


def train(args, work, data, ckpt_dir: Optional[Path]) -> Optional[dict]:
    """Train ``args.method`` on ``data`` from the model of ``args.seed`` (resuming from
    ``ckpt_dir`` if it holds a checkpoint); its results (rank 0's are the ones written), or
    None if a signal stopped it after its checkpoint. Leaves no communication in flight."""
    rank, size = hvc.rank(), hvc.size()
    (xtr, ytr), (xte, yte) = data
    model = work.model(args.seed)
    build, bytes_of = METHODS[args.method]
    inner = (torch.optim.AdamW(model.parameters(), lr=args.lr) if work.adam else
             torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    model, opt = build(inner, model)
    hvc.broadcast_parameters(model.state_dict(), root_rank=0)
    per_rank = len(xtr) // size
    steps = per_rank // args.batch
    history, train_time, samples, sent = [], 0.0, 0, []
    done, total_loss = 0, 0.0  # steps done in all; the loss summed over this epoch's steps
    if ckpt_dir is not None:
        resumed = resume(ckpt_dir, args, size, model, opt)
        if resumed is not None:
            done, total_loss = resumed["done"], resumed["total_loss"]
            history, train_time, samples, sent = (resumed["history"], resumed["train_time"],
                                                  resumed["samples"], resumed["sent"])
            if rank == 0:
                print(f"[{args.method}] resumed from step {done} (epoch {done // steps + 1}, "
                      f"batch {done % steps}) of {ckpt_dir}", flush=True)
    start = done
    for epoch in range(done // steps, args.epochs):
        for group in opt.param_groups:  # from the epoch alone: a resumed run sets the same
            group["lr"] = work.lr_at(args.lr, epoch, args.epochs)
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(1000 + epoch))
        mine = order[rank::size][:per_rank]
        model.train()
        t0 = time.perf_counter()
        for s in range(done % steps if epoch == done // steps else 0, steps):
            g = epoch * steps + s  # the steps done: a step boundary
            stopping = ckpt_dir is not None and preemption.requested()  # collective
            if stopping or (args.checkpoint_every and g > start and
                            g % args.checkpoint_every == 0):
                progress = {"done": g, "total_loss": total_loss, "history": history,
                            "samples": samples, "sent": sent, "train_time": train_time +
                            MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)}
                if stopping:
                    stop(ckpt_dir, args, size, model, opt, progress)
                    return None
                checkpoint.save(ckpt_dir, g, state(args, size, model, opt, progress))
                checkpoint.prune(ckpt_dir)
            idx = mine[s * args.batch:(s + 1) * args.batch]
            opt.zero_grad()
            loss = work.loss(model, xtr[idx], ytr[idx])
            loss.backward()
            opt.step()
            total_loss += loss.item()
            sent.append(bytes_of(opt, model))
            if args.step_sleep:
                time.sleep(args.step_sleep)
        train_time += MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        samples += steps * args.batch * size
        evaluated = model
        if getattr(opt, "delay", None) is not None:  # delayed: test the global weights
            evaluated = copy.deepcopy(model)
            evaluated.load_state_dict(opt.global_weights(), strict=False)
        evaluated.eval()
        # rank 0's model (the others may differ: DDP's post-local SGD); one rank evaluating
        # leaves the others' cores to it; unwrapped, as DDP's forward is a collective
        metric = MPI.COMM_WORLD.bcast(
            work.evaluate(getattr(evaluated, "module", evaluated), xte, yte) if rank == 0
            else None)
        loss_avg = MPI.COMM_WORLD.allreduce(total_loss / steps) / size
        history.append({"epoch": epoch + 1, "train_loss": loss_avg, "metric": metric,
                        "train_time_s": train_time})
        done, total_loss = (epoch + 1) * steps, 0.0
        if rank == 0:
            print(f"[{args.method}] epoch {epoch + 1:3d}/{args.epochs}  loss {loss_avg:.4f}  "
                  f"{work.metric} {metric:.4f}  ({train_time:.1f} s)", flush=True)
    digests = MPI.COMM_WORLD.allgather(report.weights_digest(evaluated.named_parameters()))
    digest = digests[0] if len(set(digests)) == 1 else "ranks differ"
    if rank == 0:
        print(f"[{args.method}] final {work.metric} {history[-1]['metric']:.4f}, "
              f"throughput {samples / train_time:.0f} samples/s, train time {train_time:.1f} s",
              flush=True)
        print(f"[{args.method}] final weights sha256 {digest}", flush=True)
    if hasattr(opt, "finish_pending"):  # hvcomm's: nothing left in flight for the next method
        opt.finish_pending()
    MPI.COMM_WORLD.barrier()
    return {"workload": args.workload, "metric": work.metric,
            "higher_is_better": work.higher_is_better,
            "method": args.method, "ranks": size, "epochs": args.epochs,
            "delay_warmup_steps": args.delay_warmup, "lr": args.lr,
            "batch_per_rank": args.batch, "history": history,
            "throughput": samples / train_time, "train_time_s": train_time,
            "bytes_per_iter_per_rank": float(np.mean(sent)),
            "params": sum(p.numel() for p in model.parameters()),
            "final_metric": history[-1]["metric"],
            "final_weights_sha256": digest}


def run_identity(args, size: int) -> dict:
    """What a checkpoint must match to be resumed: the world size and the run's settings."""
    return {"size": size, "workload": args.workload, "method": args.method, "seed": args.seed,
            "batch": args.batch, "epochs": args.epochs, "lr": args.lr}


def state(args, size: int, model, opt, progress: dict) -> dict:
    """This rank's checkpoint: what the run is (checked on resume), model, optimizer (with
    hvcomm's per-rank state), the RNG, and ``progress`` (steps done, the epoch's loss so far,
    the history and counters the results are made of)."""
    return {**run_identity(args, size), "model": model.state_dict(),
            "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(), **progress}


def stop(ckpt_dir: Path, args, size: int, model, opt, progress: dict) -> None:
    """Every rank: save this rank's checkpoint of step ``progress["done"]``; then rank 0 writes
    DIR/preempted.json, which tells the batch script that the whole checkpoint is there."""
    rank, done = hvc.rank(), progress["done"]
    checkpoint.save(ckpt_dir, done, state(args, size, model, opt, progress))
    signals = MPI.COMM_WORLD.gather(preemption.received())
    hvc.mpi_comm().barrier()  # every rank's file is in place
    if rank == 0:
        got = sorted({signal.Signals(s).name for s in signals if s is not None})
        text = json.dumps({"step": done, "size": size, "signals": got,
                           "ranks_signalled": sum(s is not None for s in signals)}).encode()
        durable.write(ckpt_dir / "preempted.json", lambda f: f.write(text))
        print(f"[{args.method}] {'/'.join(got)} received: checkpoint of step {done} written by "
              f"all {size} ranks to {ckpt_dir}; stopping", flush=True)


def resume(ckpt_dir: Path, args, size: int, model, opt):
    """COLLECTIVE: load the newest checkpoint every rank has in ``ckpt_dir``; None if there
    is none. A checkpoint of another world size or run (:func:`run_identity`) is an error."""
    step = checkpoint.newest_common(ckpt_dir)
    if step is None:
        return None
    state = checkpoint.load(ckpt_dir, step)
    ours = run_identity(args, size)
    theirs = {k: state.get(k) for k in ours}
    if MPI.COMM_WORLD.allreduce(int(theirs != ours), op=MPI.MAX):
        if hvc.rank() == 0:
            print(f"train: {ckpt_dir} holds a checkpoint of step {step} of another run "
                  f"({theirs}, this one is {ours}): not resuming from it; remove it or choose "
                  "another --checkpoint-dir", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(2)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if hasattr(model, "post_local_state"):
        ddp_peer.resume_local_sgd(model, opt)
    torch.set_rng_state(state["torch_rng"])
    return state


if __name__ == "__main__":
    main()
