"""The main job: train the three workloads of scripts/workloads.py (the digits MLP, a 1-D CNN
on MNIST-1D, a character transformer on the standard library's source), 4 ranks each, and
compare the methods (the digits: every one; the others: hvcomm's defaults, :data:`COMPACT`),
with PyTorch DDP's dense, fp16, PowerSGD and post-local SGD (gloo, on the same hosts) beside
hvcomm's.

By default the ranks run on an emulated cluster, one host per rank joined by 1 Gbit/s links
(the network hvcomm is for), where root and network namespaces allow; elsewhere, and with
``--net shm``, on this machine's shared memory. It says which it used. Each framework's
methods run in turn in one mpirun (scripts/train.py --methods: each from the same seed, its
predecessor's communication finished and its model and optimizer freed; Horovod's never-ending
background thread never shares a process with another framework's method). Prints
per-epoch progress and each workload's table (with each method's time to reach dense's final
metric less a margin, :data:`MARGIN`); writes results/main_job*.md (tables and the metric
per epoch) and a plot of each workload's curves.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

from hvcomm.cluster.launch import PORTABLE_KERNELS, kernels_in_use
import report
import train

SCRIPT = Path(train.__file__).resolve()


# Random-k diverges on this job at the learning rate every other method shares (lr 0.05,
# momentum 0.9), in both variants, at densities 0.01 and 0.1; at density 1.0 it equals dense.
# Each coordinate is updated about every d/k steps: with error feedback it then receives d/k
# steps' worth at once (amplified by momentum), unbiased it carries d/k times the variance.
# Measured in results/randomk.md (python scripts/main_job.py --name randomk --methods
# hvcomm-dense randomk-0.01 randomk-0.01-ef randomk-0.1 randomk-0.1-ef randomk-1.0).
NOT_BY_DEFAULT = ("randomk",)

DENSE = "hvcomm-dense"
# the rows of the CNN's and the transformer's tables (the digits': every method available):
# hvcomm's default methods beside DDP's counterparts
COMPACT = ("hvcomm-dense", "ddp-dense", "hvcomm-fp16", "ddp-fp16", "powersgd-4",
           "ddp-powersgd-4", "gtopk-0.001", "local-sgd-8", "diloco-8", "ddp-post-local-sgd-8")
# the target of the time to target: dense's final accuracy less this (a fraction: 0.005 is
# half a point); the transformer: dense's bits per character times 1 + this
MARGIN = {"digits": 0.005, "cnn": 0.01, "transformer": 0.02}


def methods_available(workload: str):
    names = [m for m in train.METHODS if not m.startswith(NOT_BY_DEFAULT)]
    if workload != "digits":
        names = [m for m in names if m in COMPACT]
    if importlib.util.find_spec("horovod") is None:
        names = [m for m in names if train.framework(m) != "horovod"]
    return names


def plot(results, path: Path, title: str, metric: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ax.plot([h["epoch"] for h in r["history"]], [h["metric"] for h in r["history"]],
                label=r["method"], linestyle="--" if "dense" in r["method"] else "-")
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_methods(args, workload, methods, net, label):
    """Each framework's methods (hvcomm's, DDP's, Horovod's) in turn in one mpirun; the result
    of each method, in the order of ``methods``."""
    tmp = Path(tempfile.mkdtemp(prefix="hvcomm-main-"))
    given = [f"--{option.replace('_', '-')}={value}" for option, value in
             (("epochs", args.epochs), ("batch", args.batch), ("delay_warmup", args.delay_warmup))
             if value is not None]
    groups = {}
    for m in methods:
        groups.setdefault(train.framework(m), []).append(m)
    results = {}
    for name, group in groups.items():
        print(f"== {workload} {', '.join(group)}: {args.ranks} ranks, {label}", flush=True)
        for r in report.run_worker(args.ranks, [str(SCRIPT), "--workload", workload,
                                                "--methods", *group, *given], timeout=3600,
                                   out=tmp / f"{name}.json", net=net, capture=False):
            results[r["method"]] = r
    return [results[m] for m in methods]


def target_of(workload: str, dense: dict):
    """The metric every method is timed to: dense's final one less :data:`MARGIN`."""
    final = dense["final_metric"]
    return final - MARGIN[workload] if dense["higher_is_better"] else final * (1 + MARGIN[workload])


def time_to_target(history, target, higher_is_better: bool):
    """Training time (s) at the end of the first epoch whose metric reached ``target``, or
    None if none did."""
    reached = (lambda v: v >= target) if higher_is_better else (lambda v: v <= target)
    return next((h["train_time_s"] for h in history if reached(h["metric"])), None)


def section(name, workload, args, results) -> str:
    """One workload's table, its settings, its metric per epoch and its plot."""
    first = results[0]
    metric, higher = first["metric"], first["higher_is_better"]
    dense = next((r for r in results if r["method"] == DENSE), None)
    target = None if dense is None else target_of(workload, dense)
    rows = []
    for r in results:
        row = {"method": r["method"], "throughput (samples/s)": f"{r['throughput']:.0f}",
               "bytes/iter/rank": f"{r['bytes_per_iter_per_rank']:,.0f}",
               f"final {metric}": f"{r['final_metric']:.4f}",
               "train time (s)": f"{r['train_time_s']:.2f}"}
        if target is not None:
            reached = time_to_target(r["history"], target, higher)
            row["time to target (s)"] = "not reached" if reached is None else f"{reached:.2f}"
            final_ok = time_to_target(r["history"][-1:], target, higher) is not None
            row["final within target"] = "yes" if final_ok else "NO"
        rows.append({**row, "final weights (sha256)": r["final_weights_sha256"][:16]})
    if target is None:
        to_target = f"not measured: {DENSE} was not among the methods run"
    else:
        margin = (f"less {MARGIN[workload] * 100:g} points" if higher else
                  f"plus {MARGIN[workload] * 100:g}%")
        to_target = (f"training time until the {metric} (measured after every epoch) first "
                     f"reached {target:.4f}: {DENSE}'s final {dense['final_metric']:.4f} "
                     f"{margin}")
    epochs = len(first["history"])
    per_epoch = [{"epoch": e + 1, **{r["method"]: f"{r['history'][e]['metric']:.4f}"
                                     for r in results}} for e in range(epochs)]
    text = report.table(rows)
    print("\n" + text)
    png = report.RESULTS / f"{name}_{workload}.png"
    report.RESULTS.mkdir(exist_ok=True)
    plot(results, png, f"{workload}, {args.ranks} ranks: {metric} per epoch", metric)
    settings = report.table([{"setting": k, "value": v} for k, v in {
        "workload": DESCRIBED[workload].format(params=first["params"]),
        "batch per rank, epochs, learning rate": f"{first['batch_per_rank']}, {epochs}, "
                                                 f"{first['lr']}",
        "warm-up steps of the delayed and periodic methods": first["delay_warmup_steps"],
        "time to target": to_target}.items()])
    return (f"## {workload}\n\n{settings}\n\n{text}\n\n### {metric} per epoch\n\n"
            f"{report.table(per_epoch)}\n\n![{workload}]({png.name})")


DESCRIBED = {
    "digits": "sklearn digits (1438 train / 359 test), MLP 64-512-512-10 ({params:,} "
              "parameters), SGD momentum 0.9; test accuracy",
    "cnn": "MNIST-1D generated by the mnist1d package (4,000 train / 1,000 test, length 40), "
           "1-D CNN of 3 convolutions ({params:,} parameters), SGD momentum 0.9, its learning "
           "rate annealed to 0 by a cosine over the epochs; test accuracy",
    "transformer": "bytes of the Python standard library's source (128 KiB of training "
                   "text; 64 KiB held out from files never trained on), 4 layers, width 128, "
                   "context 128 ({params:,} parameters), AdamW; bits per character on the "
                   "held-out text (lower is better)",
}


def write_report(name, args, label, sections) -> None:
    path = report.write(name, "Main job: the workloads, methods compared", report.setting(
        P=args.ranks, network=label,
        note="bytes: hvcomm counts what each rank sends (ring model for MPI's allreduce); "
             "Horovod's and DDP's are the ring model 2(P-1)/P*bytes of what their allreduces "
             "carry. ddp-*: PyTorch DDP on gloo over the same hosts, set up as "
             "scripts/ddp_peer.py says (fp16_compress_hook; powerSGD_hook at rank 4 on one "
             "bucket, from step 2; post-local SGD: post_localSGD_hook with "
             "PostLocalSGDOptimizer and PeriodicModelAverager). Sparse methods use error "
             "feedback; 'model' scope selects over the whole model, 'layerwise' per tensor. "
             "Final weights: the first 16 hex digits of the sha256 of the tested weights' bytes",
        delayed="od/ssd/cd-sgd (the digits): the workload's synchronous warm-up steps, local "
                "lr 4x the job's, k=5 (ssd: local weights reset to the global ones every 5 "
                "steps, GLU 1.0; cd: 2-bit threshold 0.5, every 5th step in full precision); "
                "the metric of the global weights",
        periodic="local-sgd-N, diloco-N and ddp-post-local-sgd-N: the same synchronous "
                 "warm-up steps, then the models averaged "
                 "every N local steps (diloco: an outer Nesterov step of lr 0.7 and momentum "
                 "0.5 on the average difference, not the paper's 0.9, which compounded with "
                 "the digits' inner SGD momentum 0.9; the transformer's inner optimizer is "
                 "AdamW); hvcomm's rows measure the global weights, DDP's rank 0's model"),
        "\n\n".join(sections))
    print(f"written to {path.relative_to(report.ROOT)}")


def write_comparison(name, args, label, runs) -> None:
    """Two runs of the same command side by side: the metric per epoch and final weights."""
    rows = []
    for workload in runs[0]:
        for a, b in zip(runs[0][workload], runs[1][workload]):
            curve = lambda r: [h["metric"] for h in r["history"]]  # noqa: E731
            rows.append({"workload": workload, "method": a["method"],
                         "final metric (run 1, run 2)": f"{a['final_metric']:.4f}, "
                                                        f"{b['final_metric']:.4f}",
                         "every epoch's metric equal": "yes" if curve(a) == curve(b) else "NO",
                         "final weights (run 1)": a["final_weights_sha256"][:16],
                         "final weights (run 2)": b["final_weights_sha256"][:16],
                         "bitwise equal": ("yes" if a["final_weights_sha256"]
                                           == b["final_weights_sha256"] else "NO")})
    text = report.table(rows)
    print("\n" + text)
    path = report.write(name, "Main job run twice: reproducibility", report.setting(
        P=args.ranks, network=label,
        runs=f"results/{args.name}.md and results/{args.name}_repeat.md, one after the other"),
        text)
    print(f"written to {path.relative_to(report.ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--ranks", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", choices=list(DESCRIBED), default=list(DESCRIBED),
                    help="default: all three (scripts/workloads.py)")
    ap.add_argument("--epochs", type=int, help="default: each workload's")
    ap.add_argument("--methods", nargs="+", help="default: all available (the CNN and the "
                                                 "transformer: COMPACT)")
    ap.add_argument("--batch", type=int, help="per rank (default: each workload's)")
    ap.add_argument("--delay-warmup", type=int,
                    help="synchronous warm-up steps of the delayed and periodic methods "
                         "(default: each workload's)")
    ap.add_argument("--name", default="main_job", help="results/<name>.md")
    ap.add_argument("--repeat", action="store_true",
                    help="run everything a second time (results/<name>_repeat.md) and compare "
                         "the two runs' metrics and final weights "
                         "(results/<name>_reproducibility.md)")
    ap.add_argument("--portable-kernels", action="store_true",
                    help=f"run torch's and MKL's {kernels_in_use(PORTABLE_KERNELS)} kernels: "
                    "slower, but the final weights' digests then compare across CPUs")
    report.add_net_option(ap, default="1gbit")
    args = ap.parse_args()
    net, label = report.resolve_net(args.net)
    print(f"main job: {args.ranks} ranks, network: {label}", flush=True)
    if args.portable_kernels:
        os.environ.update(PORTABLE_KERNELS)  # the ranks inherit them (and -x on the cluster)
    runs = [{w: run_methods(args, w, args.methods or methods_available(w), net, label)
             for w in args.workloads} for _ in range(2 if args.repeat else 1)]
    for i, run in enumerate(runs):
        name = args.name if i == 0 else f"{args.name}_repeat"
        write_report(name, args, label, [section(name, w, args, results)
                                         for w, results in run.items()])
    if args.repeat:
        write_comparison(f"{args.name}_reproducibility", args, label, runs)


if __name__ == "__main__":
    main()
