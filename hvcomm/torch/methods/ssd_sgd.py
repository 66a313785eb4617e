"""SSD-SGD: the local weights run ahead for k delayed steps, reset to the global weights every
k-th; between resets GLU adds each global update to them (``glu``; see
:mod:`hvcomm.torch.methods.delayed`)."""
from __future__ import annotations

from .delayed import DelayMethod


class SSDSGD(DelayMethod):
    def is_reset(self, delayed_index, k):
        return delayed_index % k == 0

    def local_step(self, cfg, p, W, W_before, lr, wd, reset):
        """Between resets: ``w <- w - lr * (g + wd*w) + glu * (W - W_before)``."""
        if reset:
            return super().local_step(cfg, p, W, W_before, lr, wd, reset)
        g = p.grad
        p.sub_(lr * (g + wd * p if wd else g))
        if cfg.glu and W_before is not None:
            p.add_(cfg.glu * (W - W_before))


METHOD = SSDSGD("ssd-sgd", "delayed allreduce; local steps with GLU, a reset every k steps")
