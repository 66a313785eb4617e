"""Packaging for hvcomm: the PyTorch layer (hvcomm) and the torch-free MPI collectives."""
from setuptools import find_packages, setup

setup(
    name="hvcomm",
    version="0.1.0",
    description="Communication-efficient data-parallel training: sparse collectives, "
    "merged-gradient scheduling and delayed SGD, Horovod-compatible",
    packages=find_packages(include=["hvcomm", "hvcomm.*", "collectives", "collectives.*"]),
    python_requires=">=3.9",
    install_requires=["mpi4py>=4.0", "numpy", "numba", "torch>=2.0", "tabulate"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"],
                    "examples": ["scikit-learn", "matplotlib"]},
)
