"""hvcomm.torch under mpirun at several sizes (each run bounded by a timeout)."""
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_launch import (check_passed, mpi_env, mpi_pytest, mpirun, pytest_argv, run_suites, sizes,
                        summary_counts)

# HVCOMM_LONG_PROPERTY=1: the property test draws 5,000 examples instead of 120
PROPERTY_S = 900 if os.environ.get("HVCOMM_LONG_PROPERTY", "") not in ("", "0") else 180

# The suites of tests/mpi: {file: (the sizes it runs at, its time bound in s)}. Each size's
# suites run together, in one mpirun.
SUITES = {
    "test_torch_api.py": ([1, 2, 3, 4], 180),      # the collective API
    "test_optimizer.py": ([1, 2, 3, 4], 240),      # DistributedOptimizer
    "test_reducer.py": ([1, 2, 3, 4], 300),        # compression in the optimizer
    "test_schedule.py": ([1, 2, 3], 400),          # schedules change timing, never weights
    "test_delayed.py": ([1, 2, 3], 300),           # OD / SSD / CD-SGD
    "test_periodic.py": ([1, 2, 3], 180),          # local SGD / DiLoCo
    "test_collectives_property.py": ([1, 2, 3], PROPERTY_S),  # every collective, a reference
    "test_horovod_api.py": ([1, 2, 3], 180),       # Horovod's API beyond the core
    "test_powersgd.py": ([1, 2, 3], 180),          # PowerSGD against a serial reference
    "test_preemption.py": ([1, 2], 120),           # one rank signalled, every rank told
    "test_elastic_state.py": ([1, 3], 120),        # survivors restore one commit; sync()
}


@pytest.mark.parametrize("n", sizes(SUITES))
def test_suites(n):
    run_suites(n, SUITES)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="Horovod is not installed (scripts/setup_env.sh builds it)")
@pytest.mark.parametrize("n", [2, 3])
def test_same_weights_as_horovod(n):
    mpi_pytest(n, "test_vs_horovod.py", timeout=240)


def test_failure_on_one_rank_ends_the_job():
    t0 = time.monotonic()
    proc = mpirun(3, "crash_one_rank.py", timeout=90, check_ok=False)
    assert "started size=3" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "deliberate failure" in proc.stderr
    assert "unreachable" not in proc.stdout
    assert time.monotonic() - t0 < 60


def test_unconnected_ranks_are_detected():
    """What a wrong mpirun produces: one-rank jobs that each believe they are the world."""
    env = mpi_env(2)
    proc = subprocess.run([sys.executable, *pytest_argv("test_torch_api.py")], env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0 and "wrong mpirun" in proc.stderr, proc.stdout + proc.stderr
    assert "passed" not in summary_counts(proc.stdout)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")
def test_horovodrun_launches_an_hvcomm_job():
    env = mpi_env(2)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # horovodrun calls mpirun
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2", "-H", "localhost:2",
           "--mpi", "--binding-args=--bind-to none --map-by slot --oversubscribe",
           sys.executable, *pytest_argv("test_torch_api.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    check_passed(proc, "test_torch_api.py under horovodrun -np 2")  # conftest checks the size
