"""Which method to use: every method's predicted throughput and scaling efficiency for a model
on a cluster, best first (hvcomm.sim.simulate; no MPI, no GPU needed).

    python -m hvcomm.advise --model resnet50        # v100, 4 nodes x 8 GPUs, 10gbit: assumed, said
    python -m hvcomm.advise --model vgg16 --gpu a100 --nodes 16 --gpus-per-node 8 --net 100gbit
    python -m hvcomm.advise --model resnet50 --workers 64 --net 1gbit     # 64 hosts of one GPU
    python -m hvcomm.advise --trace my_trace.json --nodes 4 --gpus-per-node 4 --intra pcie4
    python -m hvcomm.advise --measure my_model.py:make --nodes 8   # profiles your model here first
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from collectives.errors import HvcommError

from tabulate import tabulate

from hvcomm.torch import methods

from . import simulate

DEFAULT_NODES, DEFAULT_GPUS_PER_NODE, DEFAULT_NET = 4, 8, "10gbit"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_argument_group("the model (one of --model, --trace, --measure)")
    what.add_argument("--model", help="a shipped trace's model: resnet20, resnet50, vgg16, "
                      "bert-base")
    what.add_argument("--gpu", help="with --model: p102-100, v100, a100 (default "
                      f"{simulate.DEFAULT_GPU})")
    what.add_argument("--trace", help="a trace file (JSON, as in hvcomm/sim/traces/ or as "
                      "--measure writes)")
    what.add_argument("--measure", metavar="FILE.py:FACTORY",
                      help="profile your own model on this machine first: FACTORY() returns "
                      "(model, batch) or (model, batch, loss_fn); see hvcomm.sim.profile")
    what.add_argument("--steps", type=int, default=3, help="with --measure: timed steps after "
                      "one untimed warm-up (default 3)")
    what.add_argument("--save-trace", metavar="PATH", help="with --measure: where to write the "
                      "trace (default STEM-FACTORY-DEVICE.json here)")
    where = ap.add_argument_group("the cluster (--workers, or --nodes and --gpus-per-node)")
    where.add_argument("--workers", type=int, help="P hosts of one GPU each on one network")
    where.add_argument("--nodes", type=int, help=f"nodes (default {DEFAULT_NODES})")
    where.add_argument("--gpus-per-node", type=int,
                       help=f"GPUs per node, one worker each (default {DEFAULT_GPUS_PER_NODE})")
    where.add_argument("--intra", help="the link between the GPUs of a node: "
                       f"{', '.join(sorted(simulate.INTRA_LINKS))} (default: the GPU's NVLink, "
                       "else pcie3)")
    where.add_argument("--net", help="the network between nodes: "
                       f"{', '.join(sorted(simulate.NETWORKS))} (default {DEFAULT_NET})")
    ap.add_argument("--density", type=float, default=0.001,
                    help="the density of the methods that send a fraction (topk, gtopk, randomk)")
    ap.add_argument("--period", type=int, default=16,
                    help="local steps between the models' averages (local-sgd, diloco)")
    return ap


def load_trace(args, assumed: List[str], notes: List[str]) -> Tuple[simulate.LayerTrace,
                                                                      Optional[str]]:
    """The trace the arguments name, and its GPU where it is a shipped GPU's."""
    given = [flag for flag, value in (("--model", args.model), ("--trace", args.trace),
                                      ("--measure", args.measure)) if value]
    if len(given) != 1:
        raise HvcommError("give one of --model NAME (with --gpu), --trace FILE or --measure "
                          "FILE.py:FACTORY" + (f", not {' and '.join(given)}" if given else ""))
    if args.gpu and not args.model:
        raise HvcommError("--gpu picks the shipped trace of --model; --trace and --measure "
                          "bring their own times")
    if args.measure:
        from . import profile
        trace = profile.from_factory(args.measure, steps=args.steps)
        stem, _, factory = trace.model.partition(":")
        path = Path(args.save_trace or f"{stem}-{factory}-{trace.device}.json")
        trace.save(path)
        notes.append(f"trace written to {path}: reuse it with --trace {path}")
        return trace, None
    if args.trace:
        return simulate.LayerTrace.named(args.trace), None
    gpu = args.gpu or simulate.DEFAULT_GPU
    if not args.gpu:
        assumed.append(f"--gpu {gpu}")
    return simulate.LayerTrace.named(f"{args.model}-{gpu}"), gpu


def build_cluster(args, gpu: Optional[str], assumed: List[str]) -> simulate.Cluster:
    """The cluster the arguments describe, its defaults added to ``assumed``."""
    net = simulate.network(args.net or DEFAULT_NET)
    if not args.net:
        assumed.append(f"--net {net.name}")
    if args.workers is not None:
        if args.nodes is not None or args.gpus_per_node is not None or args.intra:
            raise HvcommError("--workers P is P nodes of one GPU each: give it, or --nodes N "
                              "--gpus-per-node G (with --intra LINK), not both")
        return simulate.Cluster.flat(args.workers, net)
    nodes, gpus = args.nodes, args.gpus_per_node
    if nodes is None:
        nodes = DEFAULT_NODES
        assumed.append(f"--nodes {nodes}")
    if gpus is None:
        gpus = DEFAULT_GPUS_PER_NODE
        assumed.append(f"--gpus-per-node {gpus}")
    if gpus == 1 and args.intra:
        raise HvcommError("--intra is the link between the GPUs of a node: with one GPU per "
                          "node there is none")
    intra = None
    if gpus != 1:
        intra = simulate.intra_link(args.intra or simulate.default_intra(gpu))
        if not args.intra:
            assumed.append(f"--intra {intra.name}")
    return simulate.Cluster(nodes, gpus, net, intra)


def figures(trace: simulate.LayerTrace, cluster: simulate.Cluster) -> List[Tuple[str, str]]:
    """Where each figure of the prediction comes from: (measured or assumed, what)."""
    def kind(source: str) -> str:
        return "measured" if source.startswith("measured") else "assumed"

    on = f", on {trace.measured_on}" if trace.measured_on else ""
    rows = [("measured" if trace.measured_on else "assumed",
             f"each layer's forward and backward time{on}: {trace.source}")]
    links = [("the network between nodes", cluster.inter)]
    if cluster.intra is not None:
        links.append(("the link inside a node", cluster.intra))
    for what, link in links:
        rows.append((kind(link.source), f"{what}, {link.name}: {link.bandwidth_bit_s / 1e9:.4g} "
                     f"Gbit/s each way, {link.alpha_s * 1e6:g} us a message ({link.source})"))
    compute = simulate.COMPUTE[trace.device]
    rows.append((kind(compute.source), "the local compute per element of the sparse methods, "
                 f"2-bit quantisation and PowerSGD's products ({trace.device}): {compute.source}"))
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    assumed: List[str] = []
    notes: List[str] = []
    try:
        trace, gpu = load_trace(args, assumed, notes)
        cluster = build_cluster(args, gpu, assumed)
        settings = simulate.Settings(density=args.density, period=args.period)
        ranked, left_out = simulate.compare(trace, cluster, settings=settings)
    except HvcommError as e:
        print(f"advise: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note)
    origin = gpu or (Path(args.trace).name if args.trace else trace.measured_on)
    print(f"{trace.model}: {trace.params / 1e6:.1f}M parameters, batch {trace.batch} per "
          f"worker, {trace.compute_s * 1e3:.1f} ms of computation per iteration ({origin}); "
          f"{cluster.describe()}; density {args.density}; period {args.period}")
    if assumed:
        print(f"Not given, so assumed: {', '.join(assumed)}.")
    print(tabulate([[r.method, round(r.iteration_s * 1e3, 1), round(r.throughput),
                     round(r.efficiency, 3)] for r in ranked],
                   headers=["method", "iteration ms", "samples/s", "scaling efficiency"],
                   tablefmt="github", floatfmt=".4g"))
    for name, why in left_out.items():
        print(f"No row for {name}: {why}")
    print("Where the figures come from:")
    for kind, what in figures(trace, cluster):
        print(f"- {kind}: {what}")
    exact = [m.name for m in methods.REGISTRY.values() if m.simulated and m.role == "schedule"]
    print("Predictions of the alpha-beta model (hvcomm.sim.simulate). Only the schedules ("
          f"{', '.join(exact)}) send every gradient as it is, and fp16 rounds it; the other "
          "methods change convergence, which this does not model (local-sgd and diloco, "
          "which average the models only every period steps, most of all): measure accuracy "
          "before "
          "trusting a row (random-k diverged on hvcomm's digits job at densities 0.01 and 0.1: "
          "results/randomk.md). P3 here is hvcomm's, on allreduce (one ring per slice), not "
          "the parameter server of its paper.")
    if cluster.gpus_per_node > 1:
        print("On nodes of several GPUs the dense allreduce is the hierarchical one (reduce "
              "inside each node, ring across the nodes, broadcast inside: "
              "collectives.cost.hierarchical_allreduce_s), gTop-k's tree takes its first rounds "
              "inside the node, and Top-k reduces densely inside the node before its AllGather "
              "across the nodes, a form hvcomm's runtime does not run (its Top-k AllGather is "
              "flat).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
