"""CD-SGD's 2-bit threshold quantisation: each element becomes -1, 0 or +1 (|x| >= threshold),
the codes are summed as int8 by allreduce (so P <= 127), and the result is codes * threshold;
what the codes did not carry stays in the residual."""
from __future__ import annotations

import dataclasses

import torch

from collectives.errors import HvcommError

from .base import CompressionMethod
from .compressor import Compressor, float_problem
from .payload import Payload
from .request import Request
from .schedule import dense_schedule_s
from .threshold import plan_threshold


class TwoBitCompressor(Compressor):
    error_feedback = True

    def __init__(self, threshold: float = 0.5):
        if not isinstance(threshold, (int, float)) or not threshold > 0:
            raise HvcommError(f"threshold must be > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        codes = ((tensor >= self.threshold).to(torch.int8)
                 - (tensor <= -self.threshold).to(torch.int8))
        return Payload(codes, tensor.numel(), tensor.dtype)

    def decode(self, result, payload):
        return result.to(payload.dtype) * self.threshold

    def residual(self, acc, payload):
        return acc.sub_(payload.data.to(acc.dtype) * self.threshold)

    def problem(self, request):
        if request.size > 127:
            return f"{self!r} sums int8 codes: at most 127 ranks, got {request.size}"
        return float_problem(request.dtypes, repr(self))

    def __repr__(self):
        return f"Compression.twobit(threshold={self.threshold})"


class TwoBit(CompressionMethod):
    def predict(self, case):
        """The default fusion buckets with 1-byte codes on the wire, after one pass of
        quantisation."""
        quantise = case.trace.params * case.compute.select_s_per_element
        return dense_schedule_s(dataclasses.replace(case, local_s=case.local(quantise)),
                                plan_threshold, wire_bytes_per_param=1)

    def unmodelled(self, case):
        """Its codes are summed as int8: at most 127 workers."""
        return TwoBitCompressor().problem(Request(size=case.workers))


METHOD = TwoBit("twobit", "2-bit codes (-1, 0, +1) summed as int8, error feedback",
                factory=TwoBitCompressor)
