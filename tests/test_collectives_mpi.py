"""Collectives under mpirun at P = 1..8 (oversubscribed beyond 2 cores), against serial
references."""
import pytest

from mpi_launch import mpi_pytest


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_collectives_match_reference(n):
    mpi_pytest(n, "test_collectives.py", timeout=240)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_ring_matches_reference(n):
    mpi_pytest(n, "test_ring.py", timeout=300)


@pytest.mark.parametrize("n", [2, 3])
def test_bfloat16_through_the_optimizer(n):
    mpi_pytest(n, "test_bfloat16.py", timeout=300)
