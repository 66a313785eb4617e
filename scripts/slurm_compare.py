"""The same training run submitted with sbatch to the local Slurm and started by plain mpirun
on the emulated cluster, at 2 and 4 nodes: throughput, accuracy and final weights side by side.

Brings the local Slurm up and down itself (hvcomm.cluster.slurm_local), one node count at a
time; the plain-mpirun runs use hvcomm.cluster.netem's own emulated cluster, with the same
per-link rate and one rank per node. Writes results/slurm_local.md and the jobs' logs under
results/slurm/.
Needs root, Slurm installed (bash scripts/slurm_local.sh up installs it) and the environment.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from hvcomm.cluster import slurm_local

import report

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train.py"


def sbatch(nodes: int, launcher: str, train_args, out_dir: Path) -> dict:
    """Submit slurm/ethernet.sbatch, wait for it, and return the run's JSON and log."""
    result = out_dir / f"sbatch-{launcher}-{nodes}.json"
    log = ROOT / "results" / "slurm" / f"hvcomm-eth-{launcher}-{nodes}nodes.out"
    # the emulated nodes share this machine's cores: let idle ranks yield, as every local
    # run does (hvcomm.cluster.launch.mpi_env), not spin as a rank with a node of its own may
    env = {**slurm_local.slurm_env(), "LAUNCHER": launcher, "OMPI_MCA_mpi_yield_when_idle": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(["sbatch", "--wait", f"--nodes={nodes}", "--ntasks-per-node=1",
                           f"--output={log}", "slurm/ethernet.sbatch", str(TRAIN), *train_args,
                           "--out", str(result)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"sbatch ({launcher}, {nodes} nodes) failed, exit {proc.returncode}:"
                           f"\n{proc.stderr}\n{log.read_text() if log.exists() else ''}")
    return {**json.loads(result.read_text()), "wall": wall,
            "log": str(log.relative_to(ROOT))}


def plain_mpirun(nodes: int, rate: str, train_args, out_dir: Path) -> dict:
    t0 = time.perf_counter()
    res = report.run_worker(nodes, [str(TRAIN), *train_args], timeout=1800,
                           out=out_dir / f"mpirun-{nodes}.json", net=rate)
    return {**res, "wall": time.perf_counter() - t0, "log": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--method", default="gtopk-0.001")
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    problem = slurm_local.missing()
    if problem:
        raise SystemExit(f"slurm_compare: {problem}")
    train_args = ["--method", args.method, "--epochs", str(args.epochs)]
    out_dir = Path(tempfile.mkdtemp(prefix="hvcomm-slurm-compare-"))
    rows = []
    try:
        for nodes in args.nodes:
            slurm_local.up(nodes, args.rate)
            try:
                runs = {f"sbatch, {launcher} inside": sbatch(nodes, launcher, train_args, out_dir)
                        for launcher in ("mpirun", "srun")}
            finally:
                slurm_local.down(quiet=True)
            runs["plain mpirun (hvcomm.cluster.netem)"] = plain_mpirun(nodes, args.rate, train_args,
                                                               out_dir)
            base = runs["plain mpirun (hvcomm.cluster.netem)"]["throughput"]
            for how, r in runs.items():
                rows.append({"nodes": nodes, "P": r["ranks"], "launched by": how,
                             "throughput (samples/s)": round(r["throughput"]),
                             "vs plain mpirun": r["throughput"] / base,
                             "final test acc": r["final_metric"],
                             "final weights (sha256)": r["final_weights_sha256"],
                             "job wall s": round(r["wall"], 1), "log": r["log"]})
            print(report.table(rows[-3:]), flush=True)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    path = report.write(
        "slurm_local", "slurm/ethernet.sbatch under a real Slurm, beside plain mpirun",
        report.setting(slurm=subprocess.run(["slurmctld", "-V"], capture_output=True,
                                            text=True).stdout.strip(),
                       cluster="local Slurm (hvcomm.cluster.slurm_local): one slurmd per "
                               f"emulated node, {args.rate} per link (tc tbf), 1 rank per "
                               "node; every run with OMPI_MCA_mpi_yield_when_idle=1 (the nodes "
                               "share 2 cores)",
                       run=f"scripts/train.py {' '.join(train_args)}",
                       timing="throughput over the training epochs, as train.py reports "
                              "it; job wall time includes queueing and start-up"),
        report.table(rows))
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
