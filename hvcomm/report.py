"""Recording benchmark figures with their setting (commit, MPI, P, network) in results/."""
from __future__ import annotations

import datetime
import hashlib
import platform
import subprocess
from pathlib import Path
from typing import Dict, Optional, Sequence

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def commit() -> str:
    """Short commit hash, with '-dirty' when the tree has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def mpi_library() -> str:
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()


def setting(**extra) -> Dict[str, str]:
    base = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(), "mpi": mpi_library(), "python": platform.python_version(),
            "machine": f"{platform.machine()}, {_cpus()} cores"}
    base.update({k: str(v) for k, v in extra.items()})
    return base


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0))


def weights_digest(named_tensors) -> str:
    """sha256 of (name, tensor) pairs' names and bytes, in order: equal digests mean
    bitwise-equal weights."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def table(rows: Sequence[Dict], headers: Optional[Sequence[str]] = None, fmt: str = "github") -> str:
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
