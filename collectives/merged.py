"""Merged-gradient allreduce: many arrays packed into planned buckets, one Allreduce each.

:class:`BucketPlan` (pure data, from :mod:`collectives.plans`) needs no MPI library; the
collectives :func:`imerged_allreduce` and :func:`merged_allreduce` live in
``collectives._merged``, which imports mpi4py's MPI, and load on first access.
"""
from __future__ import annotations

import importlib

from .plans import BucketPlan

_NEED_MPI = ("imerged_allreduce", "merged_allreduce")
__all__ = ["BucketPlan", *_NEED_MPI]


def __getattr__(name):
    if name not in _NEED_MPI:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("._merged", __package__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
