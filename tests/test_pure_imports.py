"""The simulator, the planner, the advisor and the collectives' pure parts need no MPI library:
they import and run in a Python where ``from mpi4py import MPI`` fails (as it does where pip
brought mpi4py but no MPI library)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Makes mpi4py.MPI unimportable (ImportError, as a missing libmpi makes it fail), then runs BODY.
PRELUDE = """
import importlib.abc, sys
class NoMPI(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py.MPI":
            raise ImportError("mpi4py.MPI blocked: no MPI library in this test")
sys.meta_path.insert(0, NoMPI())
sys.modules.pop("mpi4py.MPI", None)
"""

BODY = """
import io, json, runpy, contextlib
import collectives, collectives.errors, collectives.cost, collectives.reference
import collectives.kernels
import collectives.sparse  # noqa: F401 (imports without MPI)
from collectives.plans import ceil_log2, index_dtype
from collectives.merged import BucketPlan
from collectives import AlphaBeta, HvcommError, gtopk_allreduce_s, ring_allreduce_s
import hvcomm, hvcomm.planner, hvcomm.sim.simulate, hvcomm.sim.advise, hvcomm.cluster.launch

report = {"ceil_log2": ceil_log2(64), "index_dtype": str(index_dtype(10)),
          "plan": BucketPlan.by_threshold([4, 4, 4], 8).buckets,
          "ring_s": ring_allreduce_s(4, 4000, AlphaBeta(10e-6, 8e-9))}

out = io.StringIO()
sys.argv = ["hvcomm.advise", "--model", "resnet50", "--gpu", "v100", "--workers", "64",
            "--net", "1gbit"]
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("hvcomm.advise", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
report["advise_exit"] = code
report["advise_out"] = out.getvalue()

report["mpi_loaded"] = "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"] is not None
try:
    from mpi4py import MPI  # noqa: F401
    report["mpi_importable"] = True
except ImportError:
    report["mpi_importable"] = False
try:  # a module that does need MPI fails here: the block works
    import collectives.dense  # noqa: F401
    report["dense_importable"] = True
except ImportError:
    report["dense_importable"] = False
print("REPORT " + json.dumps(report))
"""


def run_without_mpi(body: str, cwd: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def test_pure_parts_and_the_advisor_run_without_an_mpi_library(tmp_path: Path):
    r = run_without_mpi(BODY, tmp_path)
    assert not r["mpi_importable"] and not r["mpi_loaded"] and not r["dense_importable"], r
    assert r["ceil_log2"] == 6 and r["index_dtype"] == "int32", r
    assert r["plan"] == [[0, 1], [2]], r
    assert abs(r["ring_s"] - (2 * 3 * 10e-6 + 2 * 3 / 4 * 4000 * 8e-9)) < 1e-12, r
    assert r["advise_exit"] == 0, r["advise_out"]
    rows = {line.split("|")[1].strip() for line in r["advise_out"].splitlines()
            if line.startswith("|")}
    assert {"gtopk", "wfbp", "topk", "mgwfbp"} <= rows, r["advise_out"]
    assert "resnet50" in r["advise_out"] and "64 workers" in r["advise_out"], r["advise_out"]


def test_collectives_need_mpi_only_when_used(tmp_path: Path):
    """A bare ``import collectives`` loads no MPI, and the lazy names resolve once it is there."""
    body = """
import sys, json
import collectives as C
loaded = sorted(m for m in sys.modules if m.startswith(("collectives", "mpi4py.MPI")))
names = sorted(C.__all__)
print("REPORT " + json.dumps({"loaded": loaded, "names": names, "dir": sorted(dir(C))}))
"""
    r = run_without_mpi(body, tmp_path)
    assert r["loaded"] == ["collectives"], r["loaded"]
    assert set(r["names"]) <= set(r["dir"])
    import collectives as C   # here (with MPI): every public name resolves
    for name in C.__all__:
        assert getattr(C, name) is not None, name
    from collectives import BucketPlan, gtopk_allreduce, merged_allreduce  # noqa: F401
    import collectives.merged
    import collectives.sparse
    assert C.merged_allreduce is collectives.merged.merged_allreduce
    assert C.gtopk_allreduce is collectives.sparse.gtopk_allreduce
    assert C.BucketPlan is collectives.merged.BucketPlan is collectives.plans.BucketPlan
