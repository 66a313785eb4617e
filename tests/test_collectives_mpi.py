"""Collectives under mpirun at P = 1..8 (oversubscribed beyond 2 cores), against serial references."""
import pytest

from mpi_launch import mpirun


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_collectives_match_reference(n):
    mpirun(n, "check_collectives.py", timeout=240)
