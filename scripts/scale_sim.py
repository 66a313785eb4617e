"""Scaling efficiency from 4 to 2048 workers, predicted by hvcomm.sim.simulate, for ResNet-50 and
VGG-16 on the gTop-k paper's GPU at 1 and 10 Gbit/s: dense S-SGD (WFBP and MG-WFBP), Top-k,
gTop-k and OD-SGD. Writes results/scale_<model>.md and a plot per model.

    python scripts/scale_sim.py [--gpu p102-100] [--density 0.001]
"""
from __future__ import annotations

import argparse
import json
import statistics

from hvcomm.sim import simulate

import report

METHODS = ("wfbp", "mgwfbp", "topk", "gtopk", "od-sgd")
WORKERS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
NETS = ("1gbit", "10gbit")
# the seed papers' own figures (../shared/ALGORITHMS.md, ../shared/seeds/), for comparison
PAPERS = ("gTop-k (ICDCS 2019): 32 machines, 1 Gbps Ethernet: 2.7-12x the scaling efficiency of "
          "dense S-SGD and 1.1-1.7x that of Top-k S-SGD (VGG-16, ResNet-20, AlexNet, LSTM). "
          "MG-WFBP: better scaling than WFBP and single-message on 1/10 GbE clusters.")


def plot(rows, model, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(NETS), figsize=(11, 4.2), sharey=True)
    for ax, net in zip(axes, NETS):
        for m in METHODS:
            pts = [(r["workers"], r[m]) for r in rows if r["network"] == net]
            ax.plot([p for p, _ in pts], [e for _, e in pts], marker="o", ms=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_title(f"{model}, {net}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (predicted)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replay_error() -> str:
    """The simulator's error against every replay recorded in results/ (replay_*.json, written
    by scripts/replay.py): per replay and method, predicted / measured at each P."""
    rows = []
    for path in sorted(report.RESULTS.glob("replay_*.json")):
        data = json.loads(path.read_text())
        for method in dict.fromkeys(r["method"] for r in data["rows"]):
            mine = [r for r in data["rows"] if r["method"] == method]
            rows.append({"replay": f"{data['trace']}, {data['network']}", "method": method,
                         **{f"P={r['P']}": r["predicted / measured"] for r in mine},
                         "within 15%": f"{sum(r['within 15%'] for r in mine)} of {len(mine)}"})
    if not rows:
        return "No replay recorded in results/ yet: the rows above are the model's only.\n"
    sizes = sorted({k for r in rows for k in r if k.startswith("P=")}, key=lambda k: int(k[2:]))
    ratios = [v for r in rows for k, v in r.items() if k.startswith("P=")]
    within = sum(abs(v - 1) <= 0.15 for v in ratios)
    return ("The simulator's error against replay (predicted / measured; scripts/replay.py, "
            "results/replay_*.md): " + f"{within} of {len(ratios)} rows within 15%, median "
            f"ratio {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}."
            "\n\n" + report.table(rows, ["replay", "method", *sizes, "within 15%"]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="p102-100")
    ap.add_argument("--density", type=float, default=0.001)
    args = ap.parse_args()
    for model in ("resnet50", "vgg16"):
        trace = simulate.LayerTrace.named(f"{model}-{args.gpu}")
        rows = []
        for net in NETS:
            for p in WORKERS:
                row = {"network": net, "workers": p}
                for m in METHODS:
                    row[m] = round(simulate.iteration(m, trace, p, simulate.network(net),
                                                      args.density).efficiency, 3)
                row["gtopk / wfbp"] = round(row["gtopk"] / row["wfbp"], 1)
                row["gtopk / topk"] = round(row["gtopk"] / row["topk"], 2)
                rows.append(row)
        name = f"scale_{model}"
        plot(rows, model, report.RESULTS / f"{name}.png")
        body = (report.table(rows) + f"\n\nPlot: `results/{name}.png`.\n\nThe papers: {PAPERS}\n\n"
                + replay_error())
        path = report.write(name, f"Predicted scaling efficiency, {model}", report.setting(
            trace=f"hvcomm/sim/traces/{model}-{args.gpu}.json: {trace.source}",
            networks="; ".join(f"{n}: alpha {simulate.NETWORKS[n].alpha_s * 1e6:.0f} us, "
                               f"{simulate.NETWORKS[n].bandwidth_bit_s / 1e9:.0f} Gbit/s"
                               for n in NETS),
            density=str(args.density),
            compute="sparse methods' local compute: hvcomm.sim.simulate.COMPUTE['gpu'] (assumed)",
            efficiency="computation of one worker / predicted iteration time at P"), body)
        print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
