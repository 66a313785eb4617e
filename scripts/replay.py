"""Replay a traced model through hvcomm's real DistributedOptimizer (hvcomm.sim.replay) and set
each method's measured iteration time beside hvcomm.sim.simulate's prediction.

    python scripts/replay.py --trace resnet50-v100 --sizes 2 4 8 --net 1gbit
    python scripts/replay.py --trace resnet20-v100 --sizes 2 --methods wfbp gtopk --steps 5
    python scripts/replay.py --trace resnet50-v100 --sizes 4 --net 1gbit --dilate 10

Driver (default), for each P and method: first P ranks each alone (one-rank communicators,
started together on this machine's cores as the real run is), which measure the method's local
cost beyond the trace under the same sharing of the cores; then one mpirun of P ranks (one
emulated host per rank with --net). Writes results/replay_<model>_<gpu>_<net>.md (and .json,
which scripts/scale_sim.py reads for the simulator's error). The prediction uses alpha and beta
calibrated on the same communicator in the same run, and those local costs. Each measurement
is the slowest rank's mean over consecutive steps: --steps, rounded up to a multiple of the
method's cycle (Method.cycle: the delayed methods' k, the periodic methods' period), so that
every kind of step counts in its proportion. Each row also gives the ranks' skew: from their
timelines of the timed steps, how long they waited for one another at the collectives.
With --dilate D the whole cluster runs D times slower: links at rate / D (and latency x D),
every traced time x D. The network's share of a step stays what it was; the share of this
machine's own CPU work (kernel TCP, reductions, copies, engine threads, which P emulated hosts
share on 2 cores) falls about D-fold. The prediction is for the dilated cluster and is compared
in its units; each row also gives both in undilated time (divided by D). Writes
results/replay_<model>_<gpu>_<net>_dilated<D>.md; with several D (--dilate 1 4 10), one replay
at each in turn and results/replay_<model>_<gpu>_<net>_dilation.md comparing them.
Worker (--worker): runs under mpirun.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path


from hvcomm.cluster.netem import check_dilation
from hvcomm.sim import simulate
from hvcomm.torch import methods

import report

METHODS = simulate.METHODS
PREDICTION = ("hvcomm.sim.simulate with alpha and beta measured in the same mpirun (alpha: an "
              "allreduce of one float, over 2(P-1); beta: an allreduce of the whole model's "
              "gradients, less its alphas, over 2(P-1)/P of its bytes), each method's local "
              "cost from the P ranks alone, and this machine's merge/sum costs "
              "(COMPUTE['cpu'])")
# A schedule that races plans (MG-WFBP) profiles (1 skipped + 3 steps), then races up to 4 plans
# (1 warm-up + TRIAL_STEPS each) before it keeps one: its untimed steps are that many more, so
# none of the race is timed
TRIAL_STEPS = 2
RACE_STEPS = 1 + 3 + 4 * (1 + TRIAL_STEPS)
HEADERS = ("P", "method", "measured ms", "predicted ms", "predicted / measured", "within 15%")
# with --dilate D: both in undilated time (the prediction is still the dilated cluster's)
UNDILATED = ("measured ms / D", "predicted ms / D")
# the seed papers' claims, as (method, its baseline): MG-WFBP against WFBP, single-message and
# threshold merging; P3 against WFBP; the delayed methods against S-SGD (WFBP)
COMPARISONS = (("mgwfbp", "wfbp"), ("mgwfbp", "single"), ("mgwfbp", "threshold"),
               ("p3", "wfbp"), ("od-sgd", "wfbp"), ("ssd-sgd", "wfbp"), ("cd-sgd", "wfbp"))


def train_step(opt, model) -> None:
    opt.zero_grad()
    model().backward()
    opt.step()


def mean_step_s(comm, step, steps: int) -> float:
    """The slowest rank's mean time of ``steps`` consecutive steps (no barrier between them,
    so what a method overlaps across steps stays overlapped)."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / steps


def link_cost(comm, elements: int) -> "tuple[float, float]":
    """alpha and beta of the ring allreduce on ``comm``, from the two messages that matter:
    one float (latency: a fit over several sizes put the intercept at zero or below on the
    emulated links, whose token bucket lets small messages through at once) and the whole
    model's gradients (what the dense methods move per step)."""
    import numpy as np
    from mpi4py import MPI

    from collectives import time_collective

    p = comm.Get_size()
    one, full = np.ones(1, np.float32), np.ones(elements, np.float32)
    tiny = time_collective(comm, lambda: comm.Allreduce(MPI.IN_PLACE, one), 20)
    big = time_collective(comm, lambda: comm.Allreduce(MPI.IN_PLACE, full), 3)
    alpha = tiny / (2 * (p - 1))
    return alpha, max(big - tiny, 1e-12) / (2 * (p - 1) / p * full.nbytes)


def replay_settings(args):
    """The methods' settings, one object for the replay's optimizers and its predictions:
    hvcomm's defaults, ``--density``, two warm-up steps for the delayed methods (the replay
    times the steps after its own warm-up) and the race's trial steps."""
    return simulate.Settings(density=args.density, warmup_steps=2, trial_steps=TRIAL_STEPS)


def worker(args) -> None:
    import torch
    from mpi4py import MPI

    import hvcomm.torch as hvd
    from hvcomm.sim.replay import ReplayModel
    from hvcomm.torch.timeline import arrival_skew_s, rank_path

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    hvd.init(MPI.COMM_SELF if args.alone else comm)
    trace = simulate.LayerTrace.named(args.trace).dilated(args.dilate[0])
    alpha_s, beta_s_per_byte = (0.0, 0.0) if args.alone else link_cost(comm, trace.params)
    rows, skew, settings = {}, {}, replay_settings(args)
    for method in args.methods:
        model = ReplayModel(trace, rank=comm.rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                       named_parameters=model.named_parameters(),
                                       **methods.get(method).optimizer_options(
                                           settings, model))
        step = functools.partial(train_step, opt, model)
        races = getattr(methods.get(method), "race_against", ())
        for _ in range(args.warmup + (RACE_STEPS if races else 0)):
            step()
        cycle = methods.get(method).cycle(settings)
        steps = -(-args.steps // cycle) * cycle
        timeline = None if args.alone else f"{args.out}.{method}.timeline.json"
        if timeline:  # the timed steps' collectives, on every rank: how long ranks wait
            hvd.start_timeline(timeline)
        rows[method] = mean_step_s(comm, step, steps)
        if hasattr(opt, "finish_pending"):
            opt.finish_pending()
        if timeline:
            hvd.stop_timeline()
            comm.Barrier()  # every rank's file is written
            if comm.rank == 0:
                skew[method] = arrival_skew_s(
                    [rank_path(timeline, r) for r in range(comm.size)]) / steps
        del opt, model, step  # free this method's model before the next one's
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({
            "ranks": comm.size, "rows": rows, "skew_s": skew, "alpha_s": alpha_s,
            "beta_s_per_byte": beta_s_per_byte}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--alone", action="store_true",
                    help="worker: each rank replays on a one-rank communicator")
    ap.add_argument("--trace", default="resnet50-v100",
                    help="a name in hvcomm/sim/traces or a file")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--warmup", type=int, default=12,
                    help="untimed steps first (the schedules profile in them; mgwfbp gets "
                         f"{RACE_STEPS} more for its race)")
    ap.add_argument("--steps", type=int, default=10)
    report.add_net_option(ap)
    ap.add_argument("--dilate", type=float, nargs="+", default=[1.0], metavar="D",
                    help="run D times slower: links at rate / D, traced times x D (needs --net "
                         "with a rate); several: a replay at each in turn, and "
                         "results/<name>_dilation.md setting them side by side")
    ap.add_argument("--name", help="results/<name>[_dilated<D>].md (default: "
                                   "replay_<model>_<gpu>_<net>)")
    ap.add_argument("--out")
    ap.add_argument("--replot", metavar="JSON",
                    help="only redraw the plot of a recorded replay (results/replay_*.json)")
    ap.add_argument("--combine", metavar="NAME",
                    help="only write results/NAME_dilation.md from the recorded replays "
                         "results/NAME.json and results/NAME_dilated<D>.json")
    args = ap.parse_args()
    if args.worker:
        if len(args.dilate) != 1:
            ap.error("--worker replays at one --dilate")
        return worker(args)
    if args.combine:
        return combine(args.combine)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        return plot(data["rows"], label(data), Path(args.replot).with_suffix(".png"))
    factors = [check_dilation(d) for d in args.dilate]
    net, network = report.resolve_net(args.net)
    if net == "shm" and factors != [1]:
        ap.error(f"--dilate needs an emulated network (--net with a rate); this run would use "
                 f"{network}")
    trace = simulate.LayerTrace.named(args.trace)
    name = args.name or f"replay_{trace.model}_{Path(args.trace).stem.split('-', 1)[-1]}_{net}"
    rows = {d: replay(args, d, net, network, dilated_name(name, d)) for d in factors}
    if len(factors) > 1:
        path = write_dilation(name, args.trace, network, rows)
        print(f"written to {path.relative_to(report.ROOT)}")


def dilated_name(name: str, dilate: float) -> str:
    """The file name (no suffix) of the replay ``name`` at time dilation ``dilate``."""
    return name if dilate == 1 else f"{name}_dilated{dilate:g}"


def combine(name: str) -> None:
    """results/<name>_dilation.md from the replays recorded at several dilations."""
    paths = [report.RESULTS / f"{name}.json", *report.RESULTS.glob(f"{name}_dilated*.json")]
    recorded = [json.loads(p.read_text()) for p in paths if p.exists()]
    if len(recorded) < 2:
        raise SystemExit(f"replay.py: --combine needs results/{name}.json or "
                         f"results/{name}_dilated<D>.json at two dilations at least; found "
                         f"{len(recorded)}")
    recorded.sort(key=lambda data: data.get("dilate", 1))
    first = recorded[0]
    # the network as recorded (older files: only its rate, labelled as this machine would)
    network = first.get("network_label") or report.resolve_net(first["network"])[1]
    path = write_dilation(name, first["trace"], network,
                          {data.get("dilate", 1): data["rows"] for data in recorded})
    print(f"written to {path}")


def replay(args, dilate: float, net: str, network: str, name: str) -> list:
    """Every P and method at one dilation: their rows, also written to results/<name>.*."""
    trace = simulate.LayerTrace.named(args.trace).dilated(dilate)
    if dilate != 1:
        network += (f"; time dilated {dilate:g}x: links shaped to {net} / {dilate:g}, every "
                    f"traced time x {dilate:g}")
    tmp, rows, local_rows = Path(tempfile.mkdtemp(prefix="hvcomm-replay-")), [], []
    argv = [__file__, "--worker", "--trace", args.trace, "--density", str(args.density),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--dilate", str(dilate),
            "--methods"]
    for p in args.sizes:
        for method in args.methods:  # one mpirun each: every method starts from a fresh process
            # P ranks alone first, together on this machine's cores: the method's cost beyond
            # the trace (selection, error feedback, hooks, copies, update) when P ranks share
            # the cores
            alone = report.run_worker(p, argv + [method, "--alone"], timeout=3600,
                                     out=tmp / f"{p}-{method}-alone.json")["rows"][method]
            local = max(alone - trace.compute_s, 0.0)
            local_rows.append({"P": p, "method": method, "alone ms": round(alone * 1e3, 1),
                               "local ms (beyond the trace)": round(local * 1e3, 1)})
            res = report.run_worker(p, argv + [method], timeout=3600,
                                   out=tmp / f"{p}-{method}.json", net=net, dilate=dilate)
            fitted = simulate.Network("calibrated", res["alpha_s"], 8 / res["beta_s_per_byte"],
                                      "measured: the replay's own allreduces (calibrated)")
            measured = res["rows"][method]
            pred = simulate.iteration(method, trace, simulate.Cluster.flat(p, fitted),
                                      replay_settings(args), compute=simulate.COMPUTE["cpu"],
                                      local_s=local).iteration_s
            rows.append({"P": p, "method": method, "measured ms": round(measured * 1e3, 1),
                         "predicted ms": round(pred * 1e3, 1),
                         "predicted / measured": round(pred / measured, 3),
                         "within 15%": abs(pred / measured - 1) <= 0.15,
                         "alpha us": round(res["alpha_s"] * 1e6, 1),
                         "Gbit/s": round(fitted.bandwidth_bit_s / 1e9, 3),
                         "skew ms": round(res["skew_s"][method] * 1e3, 1),
                         **(dict(zip(UNDILATED, (round(measured * 1e3 / dilate, 1),
                                                 round(pred * 1e3 / dilate, 1))))
                            if dilate != 1 else {})})
            print(f"dilated {dilate:g}x\n" + report.table(rows[-1:], HEADERS), flush=True)
            # after each method: what was measured is kept if a later one fails
            path = write(name, net, network, args, dilate, trace, rows, local_rows)
    print(f"written to {path.relative_to(report.ROOT)}")
    return rows


def label(data: dict) -> str:
    """A recorded replay (its JSON) in a few words: trace, network, dilation."""
    dilated = f", dilated {data['dilate']:g}x" if data.get("dilate", 1) != 1 else ""
    return f"{data['trace']}, {data['network']}{dilated}"


def plot(rows, title: str, path: Path) -> None:
    """Predicted against measured, one marker per row (method by colour, P by shape), with
    the 15% band around equality."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    shapes = dict(zip(sorted({r["P"] for r in rows}), "o^sD"))
    for i, method in enumerate(methods):
        for r in (r for r in rows if r["method"] == method):
            ax.scatter(r["measured ms"], r["predicted ms"], color=f"C{i % 10}",
                       marker=shapes[r["P"]], s=36)
    lo = min(min(r["measured ms"], r["predicted ms"]) for r in rows) * 0.8
    hi = max(max(r["measured ms"], r["predicted ms"]) for r in rows) * 1.2
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="k",
                    alpha=0.08, label="within 15%")
    for i, method in enumerate(methods):
        ax.scatter([], [], color=f"C{i % 10}", label=method)
    for p, marker in shapes.items():
        ax.scatter([], [], facecolors="none", edgecolors="k", marker=marker, label=f"P={p}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), title=title,
           xlabel="measured ms per iteration (replay)", ylabel="predicted ms (hvcomm.sim.simulate)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparisons(rows) -> list:
    """Each COMPARISONS pair at each P where both were run: the baseline's time over the
    method's, measured and predicted (above 1: the method is faster)."""
    at = {(r["P"], r["method"]): r for r in rows}
    out = []
    for p in sorted({r["P"] for r in rows}):
        for method, base in COMPARISONS:
            if (p, method) in at and (p, base) in at:
                m, b = at[p, method], at[p, base]
                measured = b["measured ms"] / m["measured ms"]
                predicted = b["predicted ms"] / m["predicted ms"]
                out.append({"P": p, "method": method, "against": base,
                            "speed-up measured": round(measured, 3),
                            "speed-up predicted": round(predicted, 3),
                            "same verdict": (measured > 1) == (predicted > 1)})
    return out


def write(name, net, network, args, dilate, trace, rows, local_rows) -> Path:
    """results/<name>.md (the tables), .png (the plot) and .json (the rows, for scale_sim)."""
    data = {"trace": args.trace, "network": net, "network_label": network, "dilate": dilate,
            "rows": rows}
    (report.RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(rows, label(data), report.RESULTS / f"{name}.png")
    within = sum(r["within 15%"] for r in rows)
    return report.write(
        name, f"Replay of {args.trace}: measured beside predicted",
        report.setting(network=network, trace=f"{args.trace}: {trace.source}",
                       steps=f"{args.warmup} untimed ({args.warmup + RACE_STEPS} for mgwfbp, "
                             f"whose race of plans takes {TRIAL_STEPS} timed steps each), then "
                             f"the slowest rank's mean over {args.steps} consecutive steps or the "
                             "next multiple of the method's cycle (k = 5 for the delayed "
                             "methods, the period, 16, for local SGD and DiLoCo); one mpirun "
                             "per P and method",
                       density=str(args.density), prediction=PREDICTION),
        "Measured and predicted (alpha and bandwidth: the calibration of that mpirun; skew: "
        "per step, how long ranks waited for one another, the time from the first rank's "
        "arrival at each collective to the last's, summed, from the ranks' timelines of the "
        "timed steps):\n\n"
        + report.table(rows, HEADERS + ("alpha us", "Gbit/s", "skew ms")
                       + UNDILATED * (dilate != 1))
        + f"\n\nWithin 15% of the measurement: {within} of {len(rows)} rows. Plot: "
        f"`results/{name}.png`.\n"
        + ("\nThe papers' comparisons, from the rows above (the baseline's time over the "
           "method's):\n\n" + report.table(comparisons(rows)) + "\n" if comparisons(rows) else "")
        + "\nP ranks alone (one-rank communicators, started together): each method's cost "
        f"beyond the trace's {trace.compute_s * 1e3:.1f} ms\n\n" + report.table(local_rows) + "\n")


def write_dilation(name: str, trace: str, network: str, rows_at: dict) -> Path:
    """results/<name>_dilation.md: each P and method's row at every dilation (``rows_at``:
    dilation -> that replay's rows), side by side: the measured step in undilated time (/ D)
    and the prediction's ratio to it."""
    rows = []
    for first in next(iter(rows_at.values())):
        row = {"P": first["P"], "method": first["method"]}
        for d, rows_d in rows_at.items():  # a replay cut short lacks the later rows: blank
            r = next((r for r in rows_d if (r["P"], r["method"]) == (first["P"],
                                                                    first["method"])), None)
            row[f"D={d:g}: measured ms / D"] = "" if r is None else round(r["measured ms"] / d, 1)
            row[f"D={d:g}: predicted / measured"] = "" if r is None else r["predicted / measured"]
        rows.append(row)
    within = {d: sum(r["within 15%"] for r in rows_d) for d, rows_d in rows_at.items()}
    files = ", ".join(f"results/{dilated_name(name, d)}.md" for d in rows_at)
    return report.write(
        f"{name}_dilation", f"Replay of {trace} at several time dilations",
        report.setting(network=network, dilations=", ".join(f"{d:g}" for d in rows_at),
                       files=files, prediction=PREDICTION),
        "Each row at every dilation D (links at the rate / D, every traced time x D; the "
        "measured step divided by D is in undilated time):\n\n" + report.table(rows)
        + "\n\nWithin 15%: " + ", ".join(f"D={d:g}: {n} of {len(rows_at[d])}"
                                          for d, n in within.items()) + ".\n")


if __name__ == "__main__":
    main()
