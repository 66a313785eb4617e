"""Random-k: k indices drawn alike on every rank (seeded by step and tensor), so the k values
are summed by a plain allreduce of k elements."""
from __future__ import annotations

import zlib

import numpy as np
import torch

from collectives.errors import HvcommError

from .base import CompressionMethod
from .compressor import Compressor, check_density, check_scope, float_problem, zero_at
from .payload import Payload
from .schedule import dense_schedule_s
from .wfbp import plan_wfbp


class RandomKCompressor(Compressor):
    """Two variants:

    - ``"unbiased"`` (default): the k values are scaled by n/k and nothing is kept back, so
      the sent vector is an unbiased estimate of the gradient (its variance grows as n/k);
    - ``"error_feedback"``: sent unscaled, and what was not sent stays in a residual that is
      added to the next step's gradient (each coordinate is sent about every n/k steps,
      carrying what it gathered meanwhile).
    """

    VARIANTS = ("unbiased", "error_feedback")

    def __init__(self, density: float, seed: int = 0, scope: str = "layer",
                 variant: str = "unbiased"):
        if variant not in self.VARIANTS:
            raise HvcommError(f"randomk variant must be one of {self.VARIANTS}, got {variant!r}")
        self.density, self.seed, self.scope = check_density(density), seed, check_scope(scope)
        self.variant = variant
        self.error_feedback = variant == "error_feedback"

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        flat = tensor.detach().reshape(-1)
        k = min(flat.numel(), max(1, int(self.density * flat.numel())))
        rng = np.random.default_rng([self.seed, step, zlib.crc32(key.encode())])
        idx = torch.from_numpy(np.sort(rng.choice(flat.numel(), k, replace=False)))
        values = flat[idx].contiguous()
        if not self.error_feedback:
            values.mul_(flat.numel() / k)
        return Payload(values, flat.numel(), tensor.dtype, k=k, indices=idx)

    def decode(self, result, payload):
        dense = torch.zeros(payload.numel, dtype=payload.dtype)
        dense[payload.indices] = result
        return dense

    def residual(self, acc, payload):
        return zero_at(acc, payload.indices)

    def problem(self, request):
        return float_problem(request.dtypes, repr(self))

    def __repr__(self):
        return (f"Compression.randomk(density={self.density}, seed={self.seed}, "
                f"scope={self.scope!r}, variant={self.variant!r})")


class RandomK(CompressionMethod):
    takes_density = True
    scope = "layer"

    def predict(self, case):
        """Each layer's k values allreduced as soon as its gradient is ready (scope "layer"):
        the WFBP pipeline with ``density`` of each layer's bytes."""
        return dense_schedule_s(case, plan_wfbp, wire_bytes_per_param=case.trace.bytes_per_param
                                * case.settings.density)


METHOD = RandomK("randomk", "k random values per tensor, the same indices on every rank",
                 factory=RandomKCompressor)
