"""The main job: train on the digits with every method, 4 ranks each, and compare them.

Each method runs in its own mpirun (so one method's background threads cannot slow another's
timing); the comparison table is printed and written to results/main_job.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

from hvcomm import launch, report

SCRIPT = Path(__file__).resolve().parent / "train_digits.py"


def methods_available():
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = sorted(mod.METHODS)
    if importlib.util.find_spec("horovod") is None:
        names = [m for m in names if not m.startswith("horovod")]
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--methods", nargs="*", help="default: all available")
    args = ap.parse_args()
    methods = args.methods or methods_available()
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="hvcomm-main-"))
    for m in methods:
        print(f"== {m}: {args.ranks} ranks", flush=True)
        r = launch.run_worker(args.ranks, [str(SCRIPT), "--method", m, "--epochs",
                                           str(args.epochs)], timeout=1800,
                              out=tmp / f"{m}.json", capture=False)
        rows.append({"method": m, "throughput (samples/s)": f"{r['throughput']:.0f}",
                     "bytes/iter/rank": f"{r['bytes_per_iter_per_rank']:,.0f}",
                     "final test acc": f"{r['final_test_acc']:.4f}",
                     "train time (s)": f"{r['train_time_s']:.2f}"})
    text = report.table(rows)
    print("\n" + text)
    first = r
    path = report.write("main_job", "Main job: digits MLP, methods compared", report.setting(
        P=args.ranks, dataset="sklearn digits (1437 train / 360 test)",
        model=f"MLP 64-512-512-10 ({first['params']} parameters)",
        batch_per_rank=first["batch_per_rank"], epochs=args.epochs,
        network="shared memory (no emulation)",
        note="bytes for Horovod are the ring model 2(P-1)/P*bytes; hvcomm counts its own"), text)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
