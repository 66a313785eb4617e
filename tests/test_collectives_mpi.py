"""Collectives under mpirun at P = 1 to 6 and 8 (oversubscribed beyond 2 cores), against
serial references."""
import pytest

from mpi_launch import run_suites, sizes

# {file of tests/mpi: (the sizes it runs at, its time bound in s)}; each size's in one mpirun
SUITES = {
    "test_collectives.py": ([1, 2, 3, 4, 5, 6, 8], 240),  # powers of two and not, odd, even
    "test_ring.py": ([1, 2, 3, 4, 5], 300),
    "test_bfloat16.py": ([2, 3], 300),  # through the optimizer
}


@pytest.mark.parametrize("n", sizes(SUITES))
def test_suites(n):
    run_suites(n, SUITES)
