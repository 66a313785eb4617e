"""Every way hvcomm synchronises gradients, one module each, and the registry that the optimizer,
the simulator, the advisor and the scripts read (:mod:`hvcomm.torch.methods.base` says what a
module declares). A new method is one new module and its name in :data:`MODULES`.

Beside them, the machinery the methods are built from: :mod:`strategy` and :mod:`sync`
(bucketed synchronous averaging), :mod:`buckets`, :mod:`reducer` (one bucket's trip),
:mod:`memory` (error feedback), :mod:`selection` (top-k selectors), :mod:`schedule` (profiling
and planned groupings), :mod:`delayed` (the global weights of the delayed modes) and
:mod:`periodic` (local SGD's and DiLoCo's periodic averaging).
Importing this package needs no MPI library.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional

from collectives.errors import HvcommError

from .base import Compressor, Method

MODULES = (
    "none", "fp16", "bf16", "topk", "gtopk", "randomk", "twobit",  # what travels (compression=)
    "powersgd",
    "mgwfbp", "merge_rule", "wfbp", "single", "threshold", "p3",  # which travel together, when
    "od_sgd", "ssd_sgd", "cd_sgd",                                # delayed synchronisation
    "local_sgd", "diloco",                                        # ... and periodic averaging
)

REGISTRY: Dict[str, Method] = {}
for _module in MODULES:
    _method = importlib.import_module(f"{__name__}.{_module}").METHOD
    assert _method.name not in REGISTRY, f"two methods named {_method.name!r}"
    REGISTRY[_method.name] = _method


def names(role: Optional[str] = None) -> List[str]:
    """The methods' names, in registry order (those of one ``role`` if given)."""
    return [m.name for m in REGISTRY.values() if role is None or m.role == role]


def get(name: str, role: Optional[str] = None) -> Method:
    """The method called ``name`` (of ``role`` if given); an unknown name lists the valid ones."""
    method = REGISTRY.get(name) if isinstance(name, str) else None
    if method is None or (role is not None and method.role != role):
        what = f"{role} method" if role else "method"
        raise HvcommError(f"unknown {what} {name!r}; choose one of {names(role)}")
    return method


class Compression:
    """Horovod's ``Compression.none`` and ``Compression.fp16``, and every compression method
    of the registry as ``Compression.<name>``: the compressor itself, or the class that takes
    the method's parameters (``Compression.gtopk(density=0.001)``)."""


for _method in REGISTRY.values():
    if _method.role == "compression":
        setattr(Compression, _method.name, _method.factory)

__all__ = ["Compression", "Compressor", "Method", "MODULES", "REGISTRY", "get", "names"]
