"""DiLoCo (Douillard et al., arXiv 2311.08105) and its streaming form (arXiv 2501.18512): the
wrapped optimizer is the inner one, run for ``period`` steps on each rank; then an outer SGD
step with Nesterov momentum on the averaged difference between the global weights and each
rank's. ``fragments`` > 1 exchanges the model's fragments in turn (a lower peak bandwidth),
``overlap_steps`` lets each exchange run while that many inner steps compute, and ``mix``
blends the arriving global fragment into the local one. The difference travels through
``compression=`` (``Compression.fp16`` or ``.bf16`` for 16 bits, or any compressor, with its error
feedback). The rules are in :mod:`hvcomm.torch.methods.periodic`."""
from __future__ import annotations

import dataclasses

from .periodic import Periodic, PeriodicMethod


@dataclasses.dataclass(frozen=True)
class DiLoCo(Periodic):
    """``DistributedOptimizer(..., delay=DiLoCo(period=16, outer_lr=0.7, outer_momentum=0.9))``
    (the paper's outer settings; its H is 500 on C4)."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    mode = "diloco"


class DiLoCoMethod(PeriodicMethod):
    settings = DiLoCo


METHOD = DiLoCoMethod("diloco", "inner steps, then an outer Nesterov step on the averaged "
                                "difference")
