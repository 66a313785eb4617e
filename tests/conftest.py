import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))                       # mpi_launch
sys.path.insert(0, str(HERE.parent / "scripts"))    # report: the benchmarks' helpers

# tests/mpi/test_*.py run on several ranks at once: the wrappers here launch them under mpirun
# (mpi_launch.mpi_pytest); collected in this process they would run as one-rank tests
collect_ignore = ["mpi"]
