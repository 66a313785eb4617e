"""OD-SGD (one-step delay SGD): every delayed step resets the local weights to the global ones
and moves them with this rank's fresh gradient, while last step's allreduce finishes
(:mod:`hvcomm.torch.methods.delayed`). ``local_optimizer="dcasgd"`` adds DC-ASGD's delay
compensation."""
from __future__ import annotations

from .delayed import DelayMethod


METHOD = DelayMethod("od-sgd", "one-step delayed allreduce; local step from the global weights")
