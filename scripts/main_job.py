"""The main job: train on the digits with every method, 4 ranks each, and compare them, with
PyTorch DDP's dense, fp16, PowerSGD and post-local SGD (gloo, on the same hosts) beside
hvcomm's.

By default the ranks run on an emulated cluster, one host per rank joined by 1 Gbit/s links
(the network hvcomm is for), where root and network namespaces allow; elsewhere, and with
``--net shm``, on this machine's shared memory. It says which it used. Each method runs in
its own mpirun (so one method's background threads cannot slow another's timing). Prints
per-epoch progress and the comparison table (with each method's time to reach dense's final
accuracy less 0.5 points); writes results/main_job*.md (table and test accuracy per epoch) and
a plot of the accuracy curves.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

from hvcomm.cluster.launch import PORTABLE_KERNELS, kernels_in_use
import report

SCRIPT = Path(__file__).resolve().parent / "train_digits.py"


# Random-k diverges on this job at the learning rate every other method shares (lr 0.05,
# momentum 0.9), in both variants, at densities 0.01 and 0.1; at density 1.0 it equals dense.
# Each coordinate is updated about every d/k steps: with error feedback it then receives d/k
# steps' worth at once (amplified by momentum), unbiased it carries d/k times the variance.
# Measured in results/randomk.md (python scripts/main_job.py --name randomk --methods
# hvcomm-dense randomk-0.01 randomk-0.01-ef randomk-0.1 randomk-0.1-ef randomk-1.0).
NOT_BY_DEFAULT = ("randomk",)

# time to accuracy: until the test accuracy first reaches dense's final one less this
ACCURACY_MARGIN = 0.005
DENSE = "hvcomm-dense"


def methods_available():
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = [m for m in mod.METHODS if not m.startswith(NOT_BY_DEFAULT)]
    if importlib.util.find_spec("horovod") is None:
        names = [m for m in names if not m.startswith("horovod")]
    return names


def plot(results, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ax.plot([h["epoch"] for h in r["history"]], [h["test_acc"] for h in r["history"]],
                label=r["method"], linestyle="--" if "dense" in r["method"] else "-")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_methods(args, methods, net, label):
    """Each method in its own mpirun; the JSON each one's rank 0 wrote."""
    results, tmp = [], Path(tempfile.mkdtemp(prefix="hvcomm-main-"))
    for m in methods:
        print(f"== {m}: {args.ranks} ranks, {label}", flush=True)
        results.append(report.run_worker(args.ranks, [str(SCRIPT), "--method", m, "--epochs",
                                                      str(args.epochs), "--batch",
                                                      str(args.batch), "--delay-warmup",
                                                      str(args.delay_warmup)], timeout=1800,
                                         out=tmp / f"{m}.json", net=net, capture=False))
    return results


def time_to_accuracy(history, target):
    """Training time (s) at the end of the first epoch whose test accuracy reached ``target``,
    or None if none did."""
    return next((h["train_time_s"] for h in history if h["test_acc"] >= target), None)


def write_report(name, args, label, results) -> None:
    dense = next((r for r in results if r["method"] == DENSE), None)
    target = None if dense is None else dense["final_test_acc"] - ACCURACY_MARGIN
    rows = []
    for r in results:
        row = {"method": r["method"], "throughput (samples/s)": f"{r['throughput']:.0f}",
               "bytes/iter/rank": f"{r['bytes_per_iter_per_rank']:,.0f}",
               "final test acc": f"{r['final_test_acc']:.4f}",
               "train time (s)": f"{r['train_time_s']:.2f}"}
        if target is not None:
            reached = time_to_accuracy(r["history"], target)
            row["time to accuracy (s)"] = "not reached" if reached is None else f"{reached:.2f}"
        rows.append({**row, "final weights (sha256)": r["final_weights_sha256"][:16]})
    if target is None:
        to_accuracy = f"not measured: {DENSE} was not among the methods run"
    else:
        to_accuracy = (f"training time until the test accuracy (checked after every epoch) "
                       f"first reached {target:.4f}: {DENSE}'s final "
                       f"{target + ACCURACY_MARGIN:.4f} less {ACCURACY_MARGIN * 100:g} points")
    per_epoch = [{"epoch": e + 1, **{r["method"]: f"{r['history'][e]['test_acc']:.4f}"
                                     for r in results}} for e in range(args.epochs)]
    text = report.table(rows)
    print("\n" + text)
    first = results[0]
    png = report.RESULTS / f"{name}_accuracy.png"
    report.RESULTS.mkdir(exist_ok=True)
    plot(results, png, f"digits MLP, {args.ranks} ranks: test accuracy per epoch")
    path = report.write(name, "Main job: digits MLP, methods compared", report.setting(
        P=args.ranks, dataset="sklearn digits (1437 train / 360 test), same seeds for every method",
        model=f"MLP 64-512-512-10 ({first['params']:,} parameters), SGD lr 0.05 momentum 0.9",
        batch_per_rank=first["batch_per_rank"], epochs=args.epochs, network=label,
        **{"time to accuracy": to_accuracy},
        note="bytes: hvcomm counts what each rank sends (ring model for MPI's allreduce); "
             "Horovod's and DDP's are the ring model 2(P-1)/P*bytes of what their allreduces "
             "carry. ddp-*: PyTorch DDP on gloo over the same hosts, set up as "
             "scripts/ddp_peer.py says (fp16_compress_hook; powerSGD_hook at rank 4 on one "
             "bucket, from step 2; post-local SGD: post_localSGD_hook with "
             "PostLocalSGDOptimizer and PeriodicModelAverager). Sparse methods use error "
             "feedback; "
             "'model' scope selects over the whole model, 'layerwise' per tensor. Final weights: "
             "the first 16 hex digits of the sha256 of the tested weights' bytes",
        delayed=f"od/ssd/cd-sgd: {args.delay_warmup} synchronous warm-up steps, local lr 0.2 "
                "(4x), k=5 (ssd: local weights reset to the global ones every 5 steps, GLU 1.0; "
                "cd: 2-bit threshold 0.5, every 5th step in full precision); test accuracy "
                "of the global weights",
        periodic=f"local-sgd-N, diloco-N and ddp-post-local-sgd-N: the same "
                 f"{args.delay_warmup} synchronous warm-up steps, then the models averaged "
                 "every N local steps (diloco: an outer Nesterov step of lr 0.7 and momentum "
                 "0.5, not the paper's 0.9, which compounds with the inner SGD's momentum 0.9, "
                 "on the average difference); hvcomm's rows test the global weights, DDP's "
                 "rank 0's model"),
        text + "\n\n## Test accuracy per epoch\n\n" + report.table(per_epoch)
        + f"\n\n![accuracy]({png.name})")
    print(f"written to {path.relative_to(report.ROOT)} and {png.relative_to(report.ROOT)}")


def write_comparison(name, args, label, runs) -> None:
    """Two runs of the same command side by side: accuracy per epoch and final weights."""
    rows = []
    for a, b in zip(*runs):
        same_curve = [h["test_acc"] for h in a["history"]] == [h["test_acc"] for h in b["history"]]
        rows.append({"method": a["method"],
                     "final test acc (run 1, run 2)": f"{a['final_test_acc']:.4f}, "
                                                      f"{b['final_test_acc']:.4f}",
                     "every epoch's test acc equal": "yes" if same_curve else "NO",
                     "final weights (run 1)": a["final_weights_sha256"][:16],
                     "final weights (run 2)": b["final_weights_sha256"][:16],
                     "bitwise equal": ("yes" if a["final_weights_sha256"]
                                       == b["final_weights_sha256"] else "NO")})
    text = report.table(rows)
    print("\n" + text)
    path = report.write(name, "Main job run twice: reproducibility", report.setting(
        P=args.ranks, epochs=args.epochs, network=label,
        runs=f"results/{args.name}.md and results/{args.name}_repeat.md, one after the other"),
        text)
    print(f"written to {path.relative_to(report.ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--methods", nargs="*", help="default: all available")
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--delay-warmup", type=int, default=100,
                    help="synchronous warm-up steps of od-sgd, ssd-sgd, cd-sgd")
    ap.add_argument("--name", default="main_job", help="results/<name>.md")
    ap.add_argument("--repeat", action="store_true",
                    help="run everything a second time (results/<name>_repeat.md) and compare "
                         "the two runs' accuracies and final weights "
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
    methods = args.methods or methods_available()
    runs = [run_methods(args, methods, net, label) for _ in range(2 if args.repeat else 1)]
    write_report(args.name, args, label, runs[0])
    if args.repeat:
        write_report(f"{args.name}_repeat", args, label, runs[1])
        write_comparison(f"{args.name}_reproducibility", args, label, runs)


if __name__ == "__main__":
    main()
