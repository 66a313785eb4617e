"""Does overlap pay on this machine? S-SGD against OD-SGD on the digits job, with a timeline.

Runs the main job's training (scripts/train.py) for hvcomm-dense and od-sgd with
HVCOMM_TIMELINE set, then reads the per-rank timelines: how long each gradient allreduce
took on the communication thread, and how long a whole step took (first launch to next first
launch). If the allreduce runs longer beside the next step's computation (od-sgd) than alone
(dense), computation and communication compete for the cores. Writes results/<name>.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
from pathlib import Path


import report

SCRIPT = Path(__file__).resolve().parent / "train.py"


def summarise(paths):
    """Median allreduce span (comm thread) and median step period (main thread), in ms,
    over the second half of the run (after warm-up), across ranks."""
    comm, period = [], []
    for path in paths:
        with open(path) as f:
            spans = [e for e in json.load(f) if e.get("ph") == "X"]
        spans.sort(key=lambda e: e["ts"])
        spans = spans[len(spans) // 2:]
        comm += [e["dur"] / 1e3 for e in spans
                 if e["tid"] == 2 and e["name"].startswith("allreduce")]
        launches = [e["ts"] for e in spans if e["name"] == "compress+launch"]
        period += [(b - a) / 1e3 for a, b in zip(launches, launches[1:])]
    return statistics.median(comm), statistics.median(period)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--ranks", type=int, default=2)
    ap.add_argument("--net", default="1gbit")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--delay-warmup", type=int, default=10)
    ap.add_argument("--name", default="overlap_p2_1gbit")
    args = ap.parse_args()
    net, label = report.resolve_net(args.net)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="hvcomm-overlap-"))
    for batch in args.batches:
        for method in ("hvcomm-dense", "od-sgd"):
            tl = tmp / f"{method}-{batch}" / "t.json"
            tl.parent.mkdir()
            os.environ["HVCOMM_TIMELINE"] = str(tl)
            res = report.run_worker(args.ranks, [
                str(SCRIPT), "--method", method, "--epochs", str(args.epochs), "--batch",
                str(batch), "--delay-warmup", str(args.delay_warmup)],
                timeout=900, out=tmp / f"{method}-{batch}.json", net=net)
            del os.environ["HVCOMM_TIMELINE"]
            comm_ms, step_ms = summarise(sorted(glob.glob(str(tl.parent / "t*.json"))))
            rows.append({"batch/rank": batch, "method": method,
                         "samples/s": f"{res['throughput']:.0f}",
                         "allreduce ms (median)": f"{comm_ms:.1f}",
                         "step ms (median)": f"{step_ms:.1f}"})
            print(rows[-1], flush=True)
    text = report.table(rows)
    print(text)
    report.write(args.name, "Overlap of computation and communication: S-SGD vs OD-SGD",
                 report.setting(P=args.ranks, network=label, epochs=args.epochs,
                                delay_warmup_steps=args.delay_warmup,
                                job="digits MLP (scripts/train.py), SGD lr 0.05 "
                                "momentum 0.9, od-sgd local lr 0.2",
                                timing="medians over the second half of each run, all ranks; "
                                "allreduce: the span of one gradient allreduce on hvcomm's "
                                "communication thread; step: between consecutive first "
                                "launches on the main thread"), text)


if __name__ == "__main__":
    main()
