"""Torch-free MPI collectives over NumPy buffers: sparse (gTop-k, Top-k AllGather), dense and
merged allreduce, and their alpha-beta cost model. No globals, nothing happens at import.

Each name below is imported from its submodule on first access (PEP 562), so that
``import collectives`` and its pure parts (``errors``, ``plans``, ``cost``'s formulas,
``reference``, ``kernels``, and ``sparse``'s and ``merged``'s helpers) need no MPI library;
the collectives import mpi4py's MPI when first used.
"""
import importlib

_SOURCES = {
    "cost": ("AlphaBeta", "Calibration", "calibrate", "gtopk_allreduce_s", "ring_allreduce_s",
             "slowest_times", "time_collective", "topk_allgather_s"),
    "dense": ("allreduce", "iallreduce", "icast_allreduce"),
    "errors": ("HvcommError", "check_agree", "raise_together"),
    "handle": ("Pending",),
    "merged": ("BucketPlan", "imerged_allreduce", "merged_allreduce"),
    "sparse": ("SparseResult", "gtopk_allreduce", "igtopk_allreduce", "index_dtype",
               "itopk_allgather", "merge_select", "select_topk", "topk_allgather"),
}
_SOURCE_OF = {name: module for module, names in _SOURCES.items() for name in names}
_SUBMODULES = ("cost", "dense", "errors", "handle", "kernels", "merged", "plans", "reference",
               "sparse", "workspace")

__all__ = [
    "AlphaBeta", "BucketPlan", "Calibration", "HvcommError", "Pending", "SparseResult",
    "allreduce", "calibrate", "check_agree", "gtopk_allreduce", "gtopk_allreduce_s",
    "iallreduce", "igtopk_allreduce", "icast_allreduce", "imerged_allreduce", "index_dtype", "itopk_allgather",
    "merge_select", "merged_allreduce", "raise_together", "ring_allreduce_s", "select_topk",
    "slowest_times",
    "time_collective", "topk_allgather", "topk_allgather_s",
]


def __getattr__(name):
    if name in _SOURCE_OF:
        value = getattr(importlib.import_module(f".{_SOURCE_OF[name]}", __name__), name)
    elif name in _SUBMODULES:   # ``collectives.sparse`` after a bare ``import collectives``
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
