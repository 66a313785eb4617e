"""Gradient compressors: Horovod's interface (``compress`` -> payload, ctx; ``decompress``),
plus the collective each one needs and the residual it leaves for error feedback.

Each compressor is stateless; residuals live in :class:`hvcomm.torch.methods.memory.ErrorFeedback`,
the step counter (density warm-up, random-k seeds) in the optimizer.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional, Tuple

import numpy as np
import torch

from collectives.errors import HvcommError
from collectives.sparse import index_dtype

from .selection import SampledTopk, exact_topk

DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)  # DGC's densities before the final one


class Compressor:
    """``collective``: "allreduce" (payload is a tensor summed in place), "allgather"
    (sparse pairs, Top-k AllGather), "gtopk" (sparse pairs, gTopKAllReduce) or
    "allreduce_values" (values at indices every rank chose alike). ``scope``: "layer"
    (compress each tensor alone), "model" (one buffer for the whole model) or "bucket"
    (follow the optimizer's fusion buckets). ``error_feedback``: keep what was not sent."""

    collective = "allreduce"
    scope = "bucket"
    error_feedback = False

    def compress(self, tensor: torch.Tensor, step: int = 0, key: str = "") -> Tuple[Any, Any]:
        raise NotImplementedError

    def decompress(self, payload: Any, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def residual(self, acc: torch.Tensor, payload: Any, ctx: Any) -> torch.Tensor:
        """What of ``acc`` the payload does not carry (before communication, as in GRACE's
        compensate -> compress -> update memory -> communicate); may reuse ``acc``."""
        raise NotImplementedError

    def settle(self, residual: torch.Tensor, payload: Any, result: Any) -> None:
        """After communication: put back into ``residual`` what was sent but not applied."""

    def problem(self, dtypes, size: int) -> Optional[str]:
        """Why this compressor cannot serve these gradient dtypes / communicator size."""
        return None


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    def compress(self, tensor, step=0, key=""):
        return tensor, None

    def decompress(self, payload, ctx):
        return payload

    def __repr__(self):
        return "Compression.none"


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); the sums are added in
    float32 and rounded to float16 once (see collectives.dense.icast_allreduce)."""

    def compress(self, tensor, step=0, key=""):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    def decompress(self, payload, ctx):
        return payload if ctx is None else payload.to(ctx)

    def __repr__(self):
        return "Compression.fp16"


def _check_density(density: float) -> float:
    if not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise HvcommError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def _float_problem(dtypes, name: str) -> Optional[str]:
    bad = sorted({str(d) for d in dtypes} - {"torch.float32", "torch.float64"})
    if bad:
        return f"{name} needs float32 or float64 gradients, got {bad}"
    return None


class TopKCompressor(Compressor):
    """Each rank sends its k largest |gradient + residual|; Top-k AllGather sums them.

    ``warmup_steps`` > 0 follows DGC's density warm-up (25%, 6.25%, 1.5625%, 0.4%, then
    ``density``), each stage a quarter of the warm-up. ``selector``: "sampled" (fast,
    exact whenever its threshold passes k elements) or "exact".
    """

    collective = "allgather"
    error_feedback = True

    def __init__(self, density: float, selector: str = "sampled", warmup_steps: int = 0,
                 scope: str = "layer"):
        self.density = _check_density(density)
        if selector not in ("sampled", "exact"):
            raise HvcommError(f"selector must be 'sampled' or 'exact', got {selector!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise HvcommError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if scope not in ("layer", "model", "bucket"):
            raise HvcommError(f"scope must be 'layer', 'model' or 'bucket', got {scope!r}")
        self.selector, self.warmup_steps, self.scope = selector, warmup_steps, scope
        self._select = SampledTopk() if selector == "sampled" else exact_topk

    def density_at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.density
        stage = step * len(DGC_WARMUP) // self.warmup_steps
        return max(DGC_WARMUP[stage], self.density)

    def k_for(self, n: int, step: int) -> int:
        return min(n, max(1, int(self.density_at(step) * n)))

    def compress(self, tensor, step=0, key=""):
        x = tensor.detach().reshape(-1).numpy()
        k = self.k_for(x.size, step)
        idx = np.sort(self._select(x, k)).astype(index_dtype(x.size))
        return (idx, np.ascontiguousarray(x[idx])), (x.size, k, tensor.dtype)

    def decompress(self, payload, ctx):
        n, _, dtype = ctx
        dense = torch.zeros(n, dtype=dtype)
        dense[torch.from_numpy(payload.indices.astype(np.int64))] = torch.from_numpy(payload.values)
        return dense

    def residual(self, acc, payload, ctx):
        acc.view(-1)[torch.from_numpy(payload[0].astype(np.int64))] = 0
        return acc

    def problem(self, dtypes, size):
        return _float_problem(dtypes, repr(self))

    def __repr__(self):
        return (f"Compression.{self.collective.replace('allgather', 'topk')}(density={self.density}, "
                f"selector={self.selector!r}, warmup_steps={self.warmup_steps}, scope={self.scope!r})")


class GTopKCompressor(TopKCompressor):
    """Top-k selection reduced by gTopKAllReduce: k pairs per round, log P rounds. Pairs
    that do not reach the global top-k (at any tree level) stay in the residual."""

    collective = "gtopk"

    def settle(self, residual, payload, result):
        lost = ~result.reached
        residual.view(-1)[torch.from_numpy(payload[0][lost].astype(np.int64))] += \
            torch.from_numpy(payload[1][lost])


class RandomKCompressor(Compressor):
    """k indices drawn alike on every rank (seeded by step and tensor), so the k values are
    summed with a plain allreduce of k elements. Two variants:

    - ``"unbiased"`` (default): the k values are scaled by n/k and nothing is kept back, so
      the sent vector is an unbiased estimate of the gradient (its variance grows as n/k);
    - ``"error_feedback"``: sent unscaled, and what was not sent stays in a residual that is
      added to the next step's gradient (each coordinate is sent about every n/k steps,
      carrying what it gathered meanwhile).
    """

    collective = "allreduce_values"
    VARIANTS = ("unbiased", "error_feedback")

    def __init__(self, density: float, seed: int = 0, scope: str = "layer",
                 variant: str = "unbiased"):
        if variant not in self.VARIANTS:
            raise HvcommError(f"randomk variant must be one of {self.VARIANTS}, got {variant!r}")
        self.density, self.seed, self.scope = _check_density(density), seed, scope
        self.variant = variant
        self.error_feedback = variant == "error_feedback"

    def compress(self, tensor, step=0, key=""):
        flat = tensor.detach().reshape(-1)
        k = min(flat.numel(), max(1, int(self.density * flat.numel())))
        rng = np.random.default_rng([self.seed, step, zlib.crc32(key.encode())])
        idx = torch.from_numpy(np.sort(rng.choice(flat.numel(), k, replace=False)))
        values = flat[idx].contiguous()
        if not self.error_feedback:
            values.mul_(flat.numel() / k)
        return values, (flat.numel(), idx, tensor.dtype)

    def decompress(self, payload, ctx):
        n, idx, dtype = ctx
        dense = torch.zeros(n, dtype=dtype)
        dense[idx] = payload
        return dense

    def residual(self, acc, payload, ctx):
        acc.view(-1)[ctx[1]] = 0
        return acc

    def problem(self, dtypes, size):
        return _float_problem(dtypes, repr(self))

    def __repr__(self):
        return (f"Compression.randomk(density={self.density}, seed={self.seed}, "
                f"scope={self.scope!r}, variant={self.variant!r})")


class TwoBitCompressor(Compressor):
    """CD-SGD's 2-bit threshold quantisation: each element becomes -1, 0 or +1 (|x| >=
    threshold), the codes are summed as int8 by allreduce (so P <= 127), and the result is
    codes * threshold; what the codes did not carry stays in the residual."""

    error_feedback = True

    def __init__(self, threshold: float = 0.5):
        if not isinstance(threshold, (int, float)) or not threshold > 0:
            raise HvcommError(f"threshold must be > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def compress(self, tensor, step=0, key=""):
        codes = (tensor >= self.threshold).to(torch.int8) - (tensor <= -self.threshold).to(torch.int8)
        return codes, tensor.dtype

    def decompress(self, payload, ctx):
        return payload.to(ctx) * self.threshold

    def residual(self, acc, payload, ctx):
        return acc.sub_(payload.to(acc.dtype) * self.threshold)

    def problem(self, dtypes, size):
        if size > 127:
            return f"{self!r} sums int8 codes: at most 127 ranks, got {size}"
        return _float_problem(dtypes, repr(self))

    def __repr__(self):
        return f"Compression.twobit(threshold={self.threshold})"


class Compression:
    """``Compression.none`` and ``Compression.fp16`` as in Horovod, and factories for the
    compressors that need parameters: ``topk``, ``gtopk``, ``randomk``, ``twobit``."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
    topk = TopKCompressor
    gtopk = GTopKCompressor
    randomk = RandomKCompressor
    twobit = TwoBitCompressor
