"""Every way hvcomm synchronises gradients, one module each, and the registry that the optimizer,
the simulator, the advisor and the scripts read (:mod:`hvcomm.torch.methods.base` says what a
module declares; :mod:`registry` holds them by name). A new method is one new module and its
name in :data:`MODULES`.

Beside them, what a method is written against: :mod:`request` (what ``problem`` judges),
:mod:`compressor`, :mod:`payload` (what travels) and :mod:`case` (what a prediction reads,
and the methods' settings); and the machinery the methods are built from: :mod:`strategy` and
:mod:`sync`
(bucketed synchronous averaging), :mod:`buckets`, :mod:`reducer` (one bucket's trip),
:mod:`memory` (error feedback), :mod:`selection` (top-k selectors), :mod:`schedule` (profiling
and planned groupings), :mod:`delayed` (the global weights of the delayed modes) and
:mod:`periodic` (local SGD's and DiLoCo's periodic averaging).
Importing this package needs no MPI library.
"""
from __future__ import annotations

import importlib

from .base import Method
from .compressor import Compressor
from .registry import REGISTRY, add, get, names

MODULES = (
    "none", "fp16", "bf16", "topk", "gtopk", "randomk", "twobit",  # what travels (compression=)
    "powersgd",
    "mgwfbp", "merge_rule", "wfbp", "single", "threshold", "p3",  # which travel together, when
    "od_sgd", "ssd_sgd", "cd_sgd",                                # delayed synchronisation
    "local_sgd", "diloco",                                        # ... and periodic averaging
)
for _module in MODULES:
    add(importlib.import_module(f"{__name__}.{_module}").METHOD)


class Compression:
    """Horovod's ``Compression.none`` and ``Compression.fp16``, and every compression method
    of the registry as ``Compression.<name>``: the compressor itself, or the class that takes
    the method's parameters (``Compression.gtopk(density=0.001)``)."""


for _method in REGISTRY.values():
    if _method.role == "compression":
        setattr(Compression, _method.name, _method.factory)

__all__ = ["Compression", "Compressor", "Method", "MODULES", "REGISTRY", "get", "names"]
