"""Torch-free MPI collectives over NumPy buffers: sparse (gTop-k, Top-k AllGather), dense (Open
MPI's, and hvcomm's pipelined ring) and merged allreduce, and their alpha-beta cost model. No
globals, nothing happens at import.

Each name below is imported from its submodule on first access (PEP 562), so that
``import collectives`` and its pure parts (``errors``, ``plans``, ``cost``'s formulas,
``reference``, ``kernels``, and ``sparse``'s and ``merged``'s helpers) need no MPI library;
the collectives import mpi4py's MPI when first used.
"""
import importlib
import importlib.util
import pkgutil
from typing import Dict, List, Sequence, Tuple


def lazy_names(package: str, namespace: dict, sources: Dict[str, Sequence[str]],
               aliases: Dict[str, Tuple[str, str]] = None) -> List[str]:
    """Give ``namespace`` (the package's ``globals()``) a ``__getattr__`` and ``__dir__``: each
    name of ``sources`` ({module: names}, ".x" relative to ``package``) comes from its module,
    each of ``aliases`` ({name: (module, attribute)}) from that attribute, and any other name
    that is a submodule is that submodule (``dir()`` lists them all); a value, once loaded,
    stays in ``namespace``.
    Returns the names, for ``__all__``. (``hvcomm.torch`` uses it too; defined here, not in a
    submodule, so that ``import collectives`` loads nothing else.)"""
    where = {name: (module, name) for module, names in sources.items() for name in names}
    where.update(aliases or {})

    def __getattr__(name):
        if name in where:
            module, attribute = where[name]
            value = getattr(importlib.import_module(module, package), attribute)
        elif importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__():
        submodules = {m.name for m in pkgutil.iter_modules(namespace.get("__path__", []))}
        return sorted(set(namespace) | set(where) | submodules)

    namespace.update(__getattr__=__getattr__, __dir__=__dir__)
    return sorted(where)


__all__ = lazy_names(__name__, globals(), {
    ".cost": ("AlphaBeta", "Calibration", "broadcast_s", "calibrate", "gtopk_allreduce_s",
              "hierarchical_allreduce_s", "reduce_s", "ring_allreduce_s", "slowest_times",
              "time_collective", "topk_allgather_s"),
    ".dense": ("allreduce", "iallreduce", "icast_allreduce"),
    ".errors": ("HvcommError", "ProcessFailure", "check_agree", "raise_together"),
    ".handle": ("Pending",),
    ".merged": ("BucketPlan", "imerged_allreduce", "merged_allreduce"),
    ".plans": ("index_dtype",),
    ".ring": ("allreduce_sum", "iallreduce_sum", "iring_allreduce", "ring_allreduce"),
    ".sparse": ("SparseResult", "gtopk_allreduce", "igtopk_allreduce", "itopk_allgather",
                "topk_allgather"),
    ".topk": ("merge_select", "select_topk"),
})
