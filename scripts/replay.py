"""Replay a traced model through hvcomm's real DistributedOptimizer (hvcomm.replay) and set
each method's measured iteration time beside hvcomm.simulate's prediction.

    python scripts/replay.py --trace resnet50-v100 --sizes 2 4 8 --net 1gbit
    python scripts/replay.py --trace resnet20-v100 --sizes 2 --methods wfbp gtopk --steps 5

Driver (default): one rank first (each method's local cost beyond the trace on this machine),
then one mpirun per P (one emulated host per rank with --net), every method in turn; writes
results/replay_<trace>_<net>.md. The prediction uses alpha and beta calibrated on the same
communicator in the same run, and the P=1 local costs. Worker (--worker): runs under mpirun.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

from hvcomm import netem, report, simulate

METHODS = ("wfbp", "single", "threshold", "mgwfbp", "p3", "topk", "gtopk", "od-sgd")
# what each replayed method is in the simulator (P3 has no model there)
PREDICTED = {m: m for m in METHODS if m != "p3"}
HEADERS = ("P", "method", "measured ms", "predicted ms", "predicted / measured", "within 15%")


def optimizer_options(method: str, density: float, hvd) -> dict:
    if method in ("wfbp", "single", "threshold", "mgwfbp", "p3"):
        return {"schedule": method}
    if method == "topk":
        return {"compression": hvd.Compression.topk(density, scope="model")}
    if method == "gtopk":
        return {"compression": hvd.Compression.gtopk(density, scope="model")}
    return {"delay": hvd.Delay(mode="od", warmup_steps=2)}


def train_step(opt, model) -> None:
    opt.zero_grad()
    model().backward()
    opt.step()


def worker(args) -> None:
    import torch
    from mpi4py import MPI

    import collectives as C
    import hvcomm.torch as hvd
    from hvcomm.replay import ReplayModel

    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    trace = simulate.LayerTrace.named(args.trace)
    cal = C.calibrate(comm)
    rows = {}
    for method in args.methods:
        model = ReplayModel(trace, rank=comm.rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                       named_parameters=model.named_parameters(),
                                       **optimizer_options(method, args.density, hvd))
        step = functools.partial(train_step, opt, model)
        for _ in range(args.warmup - 1):  # time_collective runs one more untimed
            step()
        rows[method] = C.time_collective(comm, step, args.steps)
        if hasattr(opt, "finish_pending"):
            opt.finish_pending()
        del opt, model, step  # free this method's model before the next one's
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({
            "ranks": comm.size, "rows": rows, "alpha_s": cal.alpha_beta.alpha_s,
            "beta_s_per_byte": cal.alpha_beta.beta_s_per_byte}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--trace", default="resnet50-v100", help="a name in hvcomm/traces or a file")
    ap.add_argument("--sizes", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--warmup", type=int, default=12,
                    help="untimed steps first, at least 1 (the schedules profile and race "
                         "plans in them)")
    ap.add_argument("--steps", type=int, default=8)
    netem.add_net_option(ap)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    trace = simulate.LayerTrace.named(args.trace)
    net, label = netem.resolve_net(args.net)
    tmp, rows = Path(tempfile.mkdtemp(prefix="hvcomm-replay-")), []
    argv = [__file__, "--worker", "--trace", args.trace, "--density", str(args.density),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--methods", *args.methods]
    # one rank first: each method's cost on this machine beyond the trace (its selection and
    # error feedback, the hooks, the update), which the predictions at P > 1 then include
    alone = netem.run_worker(1, argv, timeout=3600, out=tmp / "1.json")["rows"]
    local = {m: t - trace.compute_s for m, t in alone.items()}
    calibration = [{"method": m, "P=1 measured ms": round(t * 1e3, 1),
                    "local ms (beyond the trace)": round(local[m] * 1e3, 1)}
                   for m, t in alone.items()]
    for p in args.sizes:
        res = netem.run_worker(p, argv, timeout=3600, out=tmp / f"{p}.json", net=net)
        fitted = simulate.Network("calibrated", res["alpha_s"], 8 / res["beta_s_per_byte"])
        for method, measured in res["rows"].items():
            row = {"P": p, "method": method, "measured ms": round(measured * 1e3, 1)}
            if method in PREDICTED:
                pred = simulate.iteration(PREDICTED[method], trace, p, fitted, args.density,
                                          compute=simulate.COMPUTE["cpu"],
                                          local_s=local[method]).iteration_s
                row.update({"predicted ms": round(pred * 1e3, 1),
                            "predicted / measured": round(pred / measured, 3),
                            "within 15%": abs(pred / measured - 1) <= 0.15})
            rows.append(row)
        print(report.table([r for r in rows if r["P"] == p], HEADERS), flush=True)
    judged = [r for r in rows if "within 15%" in r]
    summary = (f"\n\nWithin 15% of the measurement: {sum(r['within 15%'] for r in judged)} of "
               f"{len(judged)} predicted rows.\n")
    name = f"replay_{trace.model}_{Path(args.trace).stem.split('-', 1)[-1]}_{net}"
    path = report.write(name, f"Replay of {args.trace}: measured beside predicted",
                        report.setting(network=label, trace=f"{args.trace}: {trace.source}",
                                       steps=f"{args.warmup} untimed, then the median of "
                                             f"{args.steps} (slowest rank)",
                                       density=str(args.density),
                                       prediction="hvcomm.simulate with alpha and beta "
                                                  "calibrated in the same mpirun, each method's "
                                                  "local cost from the P=1 replay, and this "
                                                  "machine's merge/sum costs (COMPUTE['cpu'])"),
                        "One rank (each method's cost on this machine beyond the trace's "
                        f"{trace.compute_s * 1e3:.1f} ms):\n\n" + report.table(calibration)
                        + "\n\nMeasured and predicted:\n\n" + report.table(rows, HEADERS)
                        + summary)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
