"""SSD-SGD: the local weights run ahead for k delayed steps, reset to the global weights every
k-th; between resets GLU adds each global update to them (``glu``; see
:mod:`hvcomm.torch.methods.delayed`)."""
from __future__ import annotations

from .delayed import DelayedMethod


class SSDSGD(DelayedMethod):
    def is_reset(self, delayed_index, k):
        return delayed_index % k == 0


METHOD = SSDSGD("ssd-sgd", "delayed allreduce; local steps with GLU, a reset every k steps")
