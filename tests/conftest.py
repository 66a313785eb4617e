import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))                       # mpi_launch
sys.path.insert(0, str(HERE.parent / "scripts"))    # report: the benchmarks' helpers
