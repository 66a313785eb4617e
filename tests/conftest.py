import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/mpi/test_*.py run on several ranks at once: the wrappers here launch them under mpirun
# (mpi_launch.mpi_pytest); collected in this process they would run as one-rank tests
collect_ignore = ["mpi"]
