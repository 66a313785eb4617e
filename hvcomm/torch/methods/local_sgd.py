"""Local SGD (Lin et al., ICLR 2020, "post-local SGD"; like PyTorch's ``PostLocalSGDOptimizer``
with ``PeriodicModelAverager``, which also averages at the first step after the warm-up):
``warmup_steps`` synchronous steps, then every rank steps on its own and the models are
averaged after every ``period``-th local step (the machinery of
:mod:`hvcomm.torch.methods.periodic`, with outer learning rate 1 and no momentum)."""
from __future__ import annotations

import dataclasses

from .periodic import Periodic, PeriodicMethod


@dataclasses.dataclass(frozen=True)
class LocalSGD(Periodic):
    """``DistributedOptimizer(..., delay=LocalSGD(period=16, warmup_steps=0))``; the outer
    step's settings are fixed (the average replaces the weights)."""

    mode = "local-sgd"

    def problem(self, request):
        fixed = dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False, fragments=1,
                     overlap_steps=0, mix=1.0)
        changed = [k for k, v in fixed.items() if getattr(self, k) != v]
        if changed:
            return (f"LocalSGD averages the models: {', '.join(changed)} cannot be set; use "
                    "DiLoCo(...) for an outer optimizer, fragments or overlap")
        return super().problem(request)


class LocalSGDMethod(PeriodicMethod):
    settings = LocalSGD


METHOD = LocalSGDMethod("local-sgd", "local steps; the models averaged every period steps")
