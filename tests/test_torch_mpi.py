"""hvcomm.torch under mpirun at several sizes (each run bounded by a timeout)."""
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_launch import HERE, mpi_env, mpirun

SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("n", SIZES)
def test_collective_api(n):
    mpirun(n, "check_torch_api.py")


@pytest.mark.parametrize("n", SIZES)
def test_distributed_optimizer(n):
    mpirun(n, "check_optimizer.py", timeout=240)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="Horovod is not installed (scripts/setup_env.sh builds it)")
@pytest.mark.parametrize("n", [2, 3])
def test_same_weights_as_horovod(n):
    mpirun(n, "check_vs_horovod.py", timeout=240)


def test_failure_on_one_rank_ends_the_job():
    t0 = time.monotonic()
    proc = mpirun(3, "crash_one_rank.py", timeout=90, check_ok=False)
    assert proc.returncode != 0
    assert "deliberate failure" in proc.stderr
    assert "unreachable" not in proc.stdout
    assert time.monotonic() - t0 < 60


def test_unconnected_ranks_are_detected():
    """What a wrong mpirun produces: one-rank jobs that each believe they are the world."""
    env = mpi_env(2)
    proc = subprocess.run([sys.executable, str(HERE / "mpi" / "check_torch_api.py")], env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0 and "wrong mpirun" in proc.stderr
    assert "OK size" not in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")
def test_horovodrun_launches_an_hvcomm_job():
    env = mpi_env(2)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # horovodrun calls mpirun
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2", "-H", "localhost:2",
           "--mpi", "--binding-args=--bind-to none --map-by slot --oversubscribe",
           sys.executable, str(HERE / "mpi" / "check_torch_api.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK size=2" in proc.stdout


@pytest.mark.parametrize("n", SIZES)
def test_compression_in_the_optimizer(n):
    mpirun(n, "check_compression.py", timeout=300)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("script, timeout", [
    ("check_schedule.py", 400),               # schedules change timing, never weights
    ("check_delayed.py", 300),                # OD / SSD / CD-SGD
    ("check_collectives_property.py", 180),   # every collective against a serial reference
    ("check_horovod_api.py", 180),            # Horovod's API beyond the core
])
def test_at_one_to_three_ranks(script, timeout, n):
    mpirun(n, script, timeout=timeout)
