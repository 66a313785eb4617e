"""The watchdog: stalls are reported and, on request, end the job; a failure on one rank
surfaces as an exception on the others instead of a hang."""
import time

import pytest

from hvcomm.cluster import launch
from mpi_launch import HERE


def run(n, *args, env=None, timeout=120):
    t0 = time.monotonic()
    proc = launch.run(n, [str(HERE / "mpi" / "stall_or_fail.py"), *args], timeout=timeout,
                      env=env or {})
    return proc, time.monotonic() - t0


def test_a_stall_is_reported_with_the_missing_rank():
    n = 3  # the report must pick the one late rank out of several
    proc, _ = run(n, "stall", "10", env={"HVCOMM_STALL_CHECK_S": "2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"ranks [{n - 1}] have not submitted it" in out, out[-3000:]
    assert "late_one (shape [4], torch.float32)" in out and f"rank 0 sum {float(n)}" in out


def test_stall_shutdown_ends_the_job():
    proc, took = run(2, "stall", "60", env={"HVCOMM_STALL_CHECK_S": "60",
                                             "HVCOMM_STALL_SHUTDOWN_S": "4"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "HVCOMM_STALL_SHUTDOWN_S=4 reached" in out, out[-3000:]
    assert "ranks [1] have not submitted it" in out
    assert took < 40, took


@pytest.mark.parametrize("variable, bad", [("HVCOMM_FUSION_THRESHOLD_BYTES", "25MB"),
                                           ("HVCOMM_STALL_SHUTDOWN_S", "-1"),
                                           ("HVCOMM_EXIT_DEADLINE_S", "nan"),
                                           ("HVCOMM_ELASTIC_DEADLINE_S", "0")])
def test_a_bad_setting_ends_the_job_with_its_name(variable, bad):
    """A bad setting ends the job (no hang) with an error naming the variable and its value."""
    proc, took = run(2, "stall", "0", env={variable: bad})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"{variable} must be a " in out and f"got {bad!r}" in out, out[-3000:]
    assert "rank 0 sum" not in out and took < 60, took


def test_a_failure_on_one_rank_raises_on_the_others():
    n = 3  # two ranks, not one, must hear of the last one's failure
    proc, took = run(n, "fail")
    out = proc.stdout + proc.stderr
    for r in range(n - 1):
        assert f"rank {r} raised after" in out and f"rank {n - 1} failed in" in out, out[-3000:]
    assert f"rank {n - 1} raised after" in out and "deliberate failure" in out
    assert took < 60, took
