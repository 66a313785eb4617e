"""Dense data-parallel training step: hvcomm's DistributedOptimizer vs Horovod's, same job shape.

Driver (default): for each P and framework, one mpirun; prints and writes
results/dense_vs_horovod.md. Worker (--worker, under mpirun): times the step.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


import report

WIDTH, LAYERS = 1600, 10  # 10 x (1600*1600 + 1600) = 25.6M parameters, 102 MB of float32


def worker(args) -> None:
    from mpi4py import MPI
    import numpy as np
    import torch

    comm = MPI.COMM_WORLD
    if args.framework == "horovod":
        import horovod.torch as dist
        dist.init(comm=comm)
    else:
        import hvcomm.torch as dist
        dist.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    opt = dist.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                    named_parameters=model.named_parameters())
    x = torch.randn(args.batch, WIDTH)
    times = []
    for i in range(args.warmup + args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    # raw MPI allreduce of the same bytes, for reference
    buf = np.ones(sum(p.numel() for p in model.parameters()), np.float32)
    raw = []
    for _ in range(3):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        raw.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if comm.Get_rank() == 0:
        steady = sorted(times[args.warmup:])
        Path(args.out).write_text(json.dumps({
            "median_step_s": steady[len(steady) // 2], "raw_allreduce_s": sorted(raw)[1],
            "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--framework", choices=["hvcomm", "horovod"], default="hvcomm")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    report.add_net_option(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    net, label = report.resolve_net(args.net)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="hvcomm-dense-"))
    for p in args.sizes:
        res = {}
        for fw in ("hvcomm", "horovod"):
            res[fw] = report.run_worker(p, [__file__, "--worker", "--framework", fw,
                                            "--batch", str(args.batch), "--warmup",
                                            str(args.warmup), "--iters", str(args.iters)],
                                        timeout=900, out=tmp / f"{fw}-{p}.json", net=net)
        ours, horovod = res["hvcomm"], res["horovod"]
        rows.append({"P": p, "hvcomm it/s": f"{1 / ours['median_step_s']:.2f}",
                     "Horovod it/s": f"{1 / horovod['median_step_s']:.2f}",
                     "hvcomm speed / Horovod's":
                         f"{horovod['median_step_s'] / ours['median_step_s']:.2f}",
                     "hvcomm step (s)": f"{ours['median_step_s']:.3f}",
                     "Horovod step (s)": f"{horovod['median_step_s']:.3f}",
                     "raw MPI Allreduce of the gradient (s)": f"{ours['raw_allreduce_s']:.3f}"})
        print(rows[-1], flush=True)
    text = report.table(rows)
    print(text)
    name = "dense_vs_horovod" + ("" if net == "shm" else f"_{net}")
    report.write(name, "Dense training step: hvcomm vs Horovod", report.setting(
        model=f"{LAYERS} x Linear({WIDTH},{WIDTH}), {res['hvcomm']['params']:,} parameters "
              "(float32)",
        batch_per_rank=args.batch, iterations=f"{args.iters} timed after {args.warmup} warm-up, "
        "median of the slowest rank", network=label + "; ranks beyond 2 are oversubscribed "
        "on 2 cores", defaults="hvcomm 25 MiB buckets; Horovod 64 MiB fusion"),
        text)


if __name__ == "__main__":
    main()
