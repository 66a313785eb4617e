"""Which method to use: every method's predicted throughput and scaling efficiency for a model
on a cluster, best first (hvcomm.sim.simulate; no MPI, no GPU needed).

    python -m hvcomm.sim.advise --model resnet50 --gpu v100 --workers 64 --net 10gbit
    python -m hvcomm.sim.advise --trace my_trace.json --workers 16 --net 1gbit --density 0.01
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from collectives.errors import HvcommError

from tabulate import tabulate

from hvcomm.torch import methods

from . import simulate


def load(args) -> simulate.LayerTrace:
    if args.trace:
        return simulate.LayerTrace.load(args.trace)
    if not (args.model and args.gpu):
        raise HvcommError("give --trace FILE, or --model and --gpu")
    return simulate.LayerTrace.named(f"{args.model}-{args.gpu}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a trace file (JSON, as in hvcomm/sim/traces/)")
    ap.add_argument("--model", help="resnet20, resnet50, vgg16, bert-base")
    ap.add_argument("--gpu", help="p102-100, v100, a100")
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--net", default="10gbit", help=", ".join(sorted(simulate.NETWORKS)))
    ap.add_argument("--density", type=float, default=0.001, help="the density of the methods that send a fraction (topk, gtopk, randomk)")
    args = ap.parse_args(argv)
    try:
        trace = load(args)
        net = simulate.network(args.net)
        ranked = simulate.compare(trace, args.workers, net, args.density)
    except HvcommError as e:
        print(f"advise: {e}", file=sys.stderr)
        return 2
    print(f"{trace.model}: {trace.params / 1e6:.1f}M parameters, batch {trace.batch} per "
          f"worker, {trace.compute_s * 1e3:.1f} ms of computation per iteration "
          f"({Path(args.trace).name if args.trace else args.gpu}); {args.workers} workers, "
          f"{net.name} (alpha {net.alpha_s * 1e6:.0f} us); density {args.density}")
    print(tabulate([[r.method, round(r.iteration_s * 1e3, 1), round(r.throughput), round(r.efficiency, 3)]
                    for r in ranked],
                   headers=["method", "iteration ms", "samples/s", "scaling efficiency"],
                   tablefmt="github", floatfmt=".4g"))
    exact = [m.name for m in methods.REGISTRY.values() if m.simulated and m.role == "schedule"]
    print("Predictions of the alpha-beta model (hvcomm.sim.simulate). Only the schedules ("
          f"{', '.join(exact)}) send every gradient as it is, and fp16 rounds it; the other "
          "methods change convergence, which this does not model: measure accuracy before "
          "trusting a row (random-k diverged on hvcomm's digits job at densities 0.01 and 0.1: "
          "results/randomk.md). P3 here is hvcomm's, on allreduce (one ring per slice), not "
          "the parameter server of its paper.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
