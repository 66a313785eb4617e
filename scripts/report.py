"""The benchmarks' helpers: running a worker on P ranks (shared memory or an emulated cluster) and
recording figures with their setting (commit, MPI, P, network) in results/."""
from __future__ import annotations

import datetime
import hashlib
import json
import sys
import platform
import subprocess
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from tabulate import tabulate

from hvcomm.cluster import launch
from hvcomm.cluster.launch import mpi_library
from hvcomm.cluster.netem import (TCP_MCA, EmulatedCluster, mca_text, parse_rate_bit_s,
                                  unsupported_reason)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def commit() -> str:
    """Short commit hash, with '-dirty' when the tree has uncommitted changes outside
    results/ (a benchmark that writes its file more than once, or runs after another whose
    file is not committed yet, still ran committed code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!results"], cwd=ROOT,
                               text=True, capture_output=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def setting(**extra) -> Dict[str, str]:
    base = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(), "mpi": mpi_library(), "python": platform.python_version(),
            "machine": f"{platform.machine()}, {_cpus()} cores", "cpu": cpu_model(),
            "torch cpu capability": torch_cpu_capability(), "kernels": launch.kernels_in_use()}
    clash = base.keys() & extra.keys()
    if clash:
        raise ValueError(f"setting(): {sorted(clash)} are recorded already; name yours apart")
    base.update({k: str(v) for k, v in extra.items()})
    return base


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo), or 'unknown'."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def torch_cpu_capability() -> str:
    """The instruction set torch picked its CPU kernels for (DEFAULT, AVX2, AVX512...): the
    same command gives bitwise the same weights only where this (and the CPU's maker, for
    MKL) is the same, unless the job runs launch.PORTABLE_KERNELS."""
    import torch
    return torch.backends.cpu.get_cpu_capability()


def weights_digest(named_tensors) -> str:
    """sha256 of (name, tensor) pairs' names and bytes, in order: equal digests mean
    bitwise-equal weights."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def table(rows: Sequence[Dict], headers: Optional[Sequence[str]] = None,
          fmt: str = "github") -> str:
    headers = list(headers or rows[0].keys())
    return tabulate([[r.get(h, "") for h in headers] for r in rows], headers=headers,
                    tablefmt=fmt, floatfmt=".4g")


def write(name: str, title: str, setting_: Dict[str, str], body: str) -> Path:
    """Write results/<name>.md: a title, the setting as a list, then the body (tables)."""
    RESULTS.mkdir(exist_ok=True)
    lines = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in setting_.items()] + ["", body, ""]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def run_worker(n: int, argv: Sequence[str], timeout: float, out: Path, net: str = "shm",
               tcp_mca: Optional[Dict[str, str]] = None, dilate: float = 1, **kw) -> Any:
    """Run ``argv --out OUT`` on n ranks and return the JSON that rank 0 wrote to OUT.

    ``net`` is "shm" (one node, shared memory) or a link rate such as "1gbit": then every
    rank runs on its own emulated host, with Open MPI's TCP settings ``tcp_mca`` (default
    hvcomm.cluster.netem.TCP_MCA), its links slowed ``dilate`` times. Raises RuntimeError
    with the tail of the output if the job fails.
    """
    argv = [*argv, "--out", str(out)]
    if net == "shm" and dilate != 1:
        raise ValueError("dilation slows emulated links; shared memory cannot be dilated: give "
                         "a link rate (--net 1gbit) or dilate 1")
    if net == "shm":
        proc = launch.run(n, argv, timeout=timeout, **kw)
    else:
        with EmulatedCluster(hosts=n, rate=net, tcp_mca=tcp_mca, dilate=dilate) as cluster:
            proc = cluster.mpirun(argv, timeout=timeout, **kw)
    if proc.returncode != 0 or not out.exists():
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-4000:]
        raise RuntimeError(f"{' '.join(map(str, argv[:1]))} on {n} ranks failed "
                           f"(exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def add_net_option(parser, default: str = "shm") -> None:
    """The ``--net`` option every benchmark takes."""
    parser.add_argument("--net", default=default,
                        help="shm (shared memory, one node) or a per-link rate for an emulated "
                             "cluster with one host per rank, e.g. 100mbit, 1gbit, 10gbit")


def resolve_net(net: str) -> Tuple[str, str]:
    """Check ``--net`` early; returns (net to run on, label to record with the results).

    Where emulation is impossible here, say so and fall back to shared memory; the label
    says what really ran."""
    if net == "shm":
        return "shm", "shared memory, one node"
    parse_rate_bit_s(net)
    reason = unsupported_reason()
    if reason:
        print(f"hvcomm: cannot emulate {net} ({reason}); running on shared memory instead",
              file=sys.stderr)
        return "shm", f"shared memory, one node (asked for {net}; emulation unavailable: {reason})"
    tcp = mca_text(TCP_MCA)
    return net, (f"emulated cluster: one host (network namespace) per rank, {net} per link "
                 f"(tc tbf both ways) into a bridge, MPI over TCP ({tcp}), Open MPI ring "
                 "allreduce")
