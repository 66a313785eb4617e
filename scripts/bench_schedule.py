"""Iteration time of each gradient schedule (WFBP, single, threshold, MG-WFBP, merge rule, P3)
beside the planner's prediction, for a many-small-layers model and a one-huge-layer model.

Driver (default): one mpirun per (model, network); writes results/schedules.md.
Worker (--worker, under mpirun): trains each schedule in turn on the same model and data.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


import report
from hvcomm.torch import methods

SCHEDULES = ("wfbp", "single", "threshold", "merge_rule", "mgwfbp", "p3", "p3:1000000")


def build_model(name: str):
    from torch import nn

    from hvcomm.sim.models import cifar_resnet

    if name.startswith("resnet"):  # CIFAR ResNet-(6n+2)
        return cifar_resnet(int(name[6:]))
    if name == "vgg":  # small VGG-style features, one huge classifier layer (VGG's fc6)
        def conv(cin, cout):
            return [nn.Conv2d(cin, cout, 3, 1, 1), nn.ReLU()]
        return nn.Sequential(*conv(3, 32), *conv(32, 32), nn.MaxPool2d(2),
                             *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
                             *conv(64, 128), *conv(128, 128), nn.Flatten(),
                             nn.Linear(128 * 8 * 8, 2048), nn.ReLU(), nn.Linear(2048, 10))
    raise ValueError(f"unknown model {name!r}")


def worker(args) -> None:
    from mpi4py import MPI
    import torch
    import hvcomm.torch as hvd

    hvd.init()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    results = {}
    for schedule in args.schedules:
        torch.manual_seed(0)
        model = build_model(args.model)
        name, _, slices = schedule.partition(":")  # "p3:N": N-element slices
        kw = {"model": model} if methods.get(name, "schedule").takes_model else {}
        if slices:
            kw["slice_elems"] = int(slices)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       schedule=name, **kw)

        def iteration():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(args.warmup):  # 1 skipped + 3 profiled, then the new plan warms up
            iteration()
        opt.finish_pending()
        samples = []
        for _ in range(args.repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                iteration()
            opt.finish_pending()
            samples.append(comm.allreduce((time.perf_counter() - t0) / args.iters, op=MPI.MAX))
        pred = opt.plan_prediction
        results[schedule] = {
            "measured_s": sorted(samples)[len(samples) // 2],
            "samples_s": samples,
            "messages": opt.comm_stats.messages,
            "predicted_s": pred.iteration_s if pred else None,
            "predicted_non_overlapped_s": pred.non_overlapped_s if pred else None,
            "predicted_backward_end_s": pred.backward_end_s if pred else None,
            "report": [p.summary() for p in opt.schedule_report],
            "trials": opt.trial_report, "plan_origin": opt.plan_origin,
        }
    if comm.Get_rank() == 0:
        params = sum(p.numel() for p in build_model(args.model).parameters())
        tensors = len(list(build_model(args.model).parameters()))
        Path(args.out).write_text(json.dumps({"results": results, "params": params,
                                              "tensors": tensors}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--models", nargs="+", default=["resnet20", "vgg"])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--nets", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--name", default="schedules")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows, labels, tmp = [], [], Path(tempfile.mkdtemp(prefix="hvcomm-sched-"))
    for net_arg in args.nets:
        net, label = report.resolve_net(net_arg)
        labels.append(label)
        for model in args.models:
            res = report.run_worker(args.n, [
                __file__, "--worker", "--model", model, "--batch", str(args.batch),
                "--warmup", str(args.warmup), "--iters", str(args.iters), "--repeats",
                str(args.repeats), "--schedules", *args.schedules],
                timeout=1800, out=tmp / f"{model}-{net}.json", net=net)
            best_base = min(res["results"][s]["measured_s"]
                            for s in ("wfbp", "single", "threshold") if s in res["results"])
            for s, r in res["results"].items():
                pred = r["predicted_s"]
                rows.append({
                    "network": net, "model": f"{model} ({res['params']:,} params, "
                                             f"{res['tensors']} tensors)",
                    "schedule": s + (f" (kept {r['plan_origin']}'s plan)"
                                     if r.get("plan_origin") else ""),
                    "messages/iter": r["messages"],
                    "measured ms": f"{1e3 * r['measured_s']:.1f}",
                    "predicted ms": "-" if pred is None else f"{1e3 * pred:.1f}",
                    "predicted/measured": "-" if pred is None else f"{pred / r['measured_s']:.2f}",
                    "pred. non-overlapped ms": ("-" if pred is None else
                                                f"{1e3 * r['predicted_non_overlapped_s']:.1f}"),
                    "vs best of wfbp/single/threshold": f"{best_base / r['measured_s']:.2f}x",
                })
                print(rows[-1], flush=True)
    text = report.table(rows)
    print(text)
    report.write(args.name, "Gradient schedules: measured iteration time and the planner's "
                 "prediction", report.setting(
                     P=args.n, batch_per_rank=args.batch, input="3x32x32 random, 10 classes",
                     network="; ".join(labels),
                     timing=f"mean of {args.iters} iterations, median of {args.repeats} "
                     f"repeats, slowest rank, after {args.warmup} warm-up iterations "
                     "(1 skipped + 3 "
                     "profiled, then mgwfbp races up to 4 plans for 1 + 5 iterations each)",
                     planner="cost fit T(M)=a+bM by hvcomm.calibrate on the job's "
                     "communicator; ready times from the gradient hooks, slowest rank",
                     threshold="25 MiB (the fusion default)",
                     p3="p3: 50,000-element slices (P3's default), p3:1000000: 1M-element "
                        "slices; updates deferred to each module's forward "
                     "(no prediction: the planner models merged buckets only)"),
                 text)


if __name__ == "__main__":
    main()
