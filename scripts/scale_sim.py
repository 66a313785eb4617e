"""Scaling efficiency from 4 to 2048 GPUs, predicted by hvcomm.sim.simulate, for ResNet-50 and
VGG-16: dense S-SGD (wfbp), fp16, Top-k, gTop-k, MG-WFBP, PowerSGD and OD-SGD, on nodes of 8
GPUs (4 and 8 GPUs: one node of 4 or 8; from 16 on: nodes of 8) with the GPU's NVLink inside
and 1, 10 or 100 Gbit/s between the nodes; beside them the papers' setting (32 hosts of one
P102-100 on 1 Gbit/s) and their figures. Writes results/scale_<model>.md and a plot per model.

    python scripts/scale_sim.py [--gpu v100] [--intra nvlink2] [--density 0.001]

Each file ends with the simulator's error against every replay recorded in results/ (the
replays on the emulated network validate the model these rows extrapolate): per P from the
time-dilated replays, then every row.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Dict

from hvcomm.sim import simulate

import replay
import report

METHODS = ("wfbp", "fp16", "topk", "gtopk", "mgwfbp", "powersgd", "od-sgd")
GPUS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
GPUS_PER_NODE = 8
NETS = ("1gbit", "10gbit", "100gbit")
# the seed papers' own figures (../shared/ALGORITHMS.md, ../shared/seeds/), for comparison,
# and the setting they were measured in
PAPERS = ("gTop-k (ICDCS 2019): 32 machines, 1 Gbps Ethernet: 2.7-12x the scaling efficiency of "
          "dense S-SGD and 1.1-1.7x that of Top-k S-SGD (VGG-16, ResNet-20, AlexNet, LSTM). "
          "MG-WFBP: better scaling than WFBP and single-message on 1/10 GbE clusters.")
PAPERS_GPU, PAPERS_HOSTS, PAPERS_NET = "p102-100", 32, "1gbit"


def cluster_of(gpus: int, intra: simulate.Network, net: simulate.Network) -> simulate.Cluster:
    """Up to one node's worth: one node of ``gpus``; more: nodes of :data:`GPUS_PER_NODE`."""
    if gpus <= GPUS_PER_NODE:
        return simulate.Cluster(1, gpus, net, intra)
    assert gpus % GPUS_PER_NODE == 0, gpus
    return simulate.Cluster(gpus // GPUS_PER_NODE, GPUS_PER_NODE, net, intra)


def efficiencies(trace: simulate.LayerTrace, cluster: simulate.Cluster,
                 density: float) -> Dict[str, float]:
    settings = simulate.Settings(density=density)
    row = {m: round(simulate.iteration(m, trace, cluster, settings).efficiency, 3)
           for m in METHODS}
    row["gtopk / wfbp"] = round(row["gtopk"] / row["wfbp"], 1)
    row["gtopk / topk"] = round(row["gtopk"] / row["topk"], 2)
    return row


def plot(rows, model, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(NETS), figsize=(5 * len(NETS), 4.2), sharey=True)
    for ax, net in zip(axes, NETS):
        for m in METHODS:
            pts = [(r["GPUs"], r[m]) for r in rows if r["network"] == net]
            ax.plot([p for p, _ in pts], [e for _, e in pts], marker="o", ms=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"GPUs (nodes of {GPUS_PER_NODE})")
        ax.set_title(f"{model}, {net} between nodes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (predicted)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def recorded_replays() -> list:
    """Every replay recorded in results/ (replay_*.json, written by scripts/replay.py), oldest
    first by the date in its .md."""
    found = []
    for path in report.RESULTS.glob("replay_*.json"):
        md = path.with_suffix(".md")
        date = re.search(r"^- date: (.+)$", md.read_text(), re.M) if md.exists() else None
        found.append((date.group(1) if date else "", path.name, json.loads(path.read_text())))
    return [data for _, _, data in sorted(found, key=lambda f: f[:2])]


def replay_error() -> str:
    """The simulator's error against every replay recorded in results/: per replay and method,
    predicted / measured at each P; and per P, one row of each setting (trace, network,
    method) from the time-dilated replays: the one at the largest dilation (the least of this
    machine's CPU in it), the newest of those."""
    rows, ratios = [], {False: [], True: []}  # dilated or not: the ratios of every row
    chosen = {}  # (trace, network, P, method) -> (dilation, ratio) of the row kept
    for data in recorded_replays():
        dilate = data.get("dilate", 1)
        for method in dict.fromkeys(r["method"] for r in data["rows"]):
            mine = [r for r in data["rows"] if r["method"] == method]
            rows.append({"replay": replay.label(data), "method": method,
                         **{f"P={r['P']}": r["predicted / measured"] for r in mine},
                         "within 15%": f"{sum(r['within 15%'] for r in mine)} of {len(mine)}"})
            ratios[dilate != 1] += [r["predicted / measured"] for r in mine]
            for r in mine if dilate != 1 else ():
                key = (data["trace"], data["network"], r["P"], method)
                if dilate >= chosen.get(key, (0, None))[0]:
                    chosen[key] = (dilate, r["predicted / measured"])
    if not rows:
        return "No replay recorded in results/ yet: the rows above are the model's only.\n"
    sizes = sorted({k for r in rows for k in r if k.startswith("P=")}, key=lambda k: int(k[2:]))

    def within(values) -> int:
        return sum(abs(v - 1) <= 0.15 for v in values)

    def summary(values) -> str:
        return (f"{within(values)} of {len(values)} rows within 15%, median ratio "
                f"{statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}")

    per_p = []
    for p in sorted({key[2] for key in chosen}):
        mine = {key: dv for key, dv in chosen.items() if key[2] == p}
        kept = [v for _, v in mine.values()]
        per_p.append({"P": p, "rows": len(mine), "within 15%": within(kept),
                      "median": round(statistics.median(kept), 3),
                      "misses": ", ".join(f"{key[3]} {v:.2f} ({key[0]}, {key[1]}, D={d:g})"
                                          for key, (d, v) in mine.items() if abs(v - 1) > 0.15)})
    # counted apart: a dilated replay repeats an undilated one's settings with the CPU's share
    # removed on purpose, so the two are different instruments
    return ("every replay recorded so far (predicted / measured; scripts/replay.py, "
            "results/replay_*.md): undilated, " + summary(ratios[False])
            + ("; time-dilated, " + summary(ratios[True]) if ratios[True] else "") + "."
            + ("\n\nThe time-dilated replays per P, one row of each setting (trace, network, "
               "method): the one at the largest dilation, the newest of those:\n\n"
               + report.table(per_p) if per_p else "")
            + "\n\nEvery row:\n\n"
            + report.table(rows, ["replay", "method", *sizes, "within 15%"]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default=simulate.DEFAULT_GPU)
    ap.add_argument("--intra", help="the link inside a node (default: the GPU's NVLink)")
    ap.add_argument("--density", type=float, default=0.001)
    args = ap.parse_args()
    intra = simulate.intra_link(args.intra or simulate.default_intra(args.gpu))
    papers_net = simulate.network(PAPERS_NET)
    common = report.setting()  # before any file is written: the commit is clean or not
    for model in ("resnet50", "vgg16"):
        trace = simulate.LayerTrace.named(f"{model}-{args.gpu}")
        rows = []
        for net in NETS:
            for gpus in GPUS:
                cluster = cluster_of(gpus, intra, simulate.network(net))
                rows.append({"network": net, "GPUs": gpus,
                             "nodes x GPUs": f"{cluster.nodes} x {cluster.gpus_per_node}",
                             **efficiencies(trace, cluster, args.density)})
        papers_trace = simulate.LayerTrace.named(f"{model}-{PAPERS_GPU}")
        papers_row = efficiencies(papers_trace, simulate.Cluster.flat(PAPERS_HOSTS, papers_net),
                                  args.density)
        name = f"scale_{model}"
        plot(rows, model, report.RESULTS / f"{name}.png")
        body = (report.table(rows) + f"\n\nPlot: `results/{name}.png`.\n\n"
                f"The papers' setting, {PAPERS_HOSTS} hosts of one {PAPERS_GPU} on "
                f"{PAPERS_NET} (hvcomm/sim/traces/{model}-{PAPERS_GPU}.json):\n\n"
                + report.table([papers_row]) + f"\n\nThe papers: {PAPERS}\n\n"
                "The simulator's error, validated against the replays: " + replay_error())
        path = report.write(name, f"Predicted scaling efficiency, {model}", dict(
            common, trace=f"hvcomm/sim/traces/{model}-{args.gpu}.json: {trace.source}",
            cluster=(f"4 and 8 GPUs: one node; from 16 on: nodes of {GPUS_PER_NODE}; inside a "
                     "node: hierarchical allreduce (collectives.cost.hierarchical_allreduce_s)"),
            intra_node=(f"{intra.name}: {intra.bandwidth_bit_s / 8e9:g} GB/s each way, alpha "
                        f"{intra.alpha_s * 1e6:g} us ({intra.source})"),
            networks="; ".join(f"{n}: alpha {simulate.NETWORKS[n].alpha_s * 1e6:.0f} us, "
                               f"{simulate.NETWORKS[n].bandwidth_bit_s / 1e9:.0f} Gbit/s"
                               for n in NETS) + f" ({simulate.NETWORKS[NETS[0]].source})",
            density=str(args.density),
            compute=f"sparse methods' local compute: {simulate.COMPUTE['gpu'].source}",
            efficiency="computation of one worker / predicted iteration time at P"), body)
        print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
