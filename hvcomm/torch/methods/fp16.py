"""16 bits on the wire (Horovod's ``Compression.fp16``): float32 and float64 gradients travel as
float16; float16 and bfloat16 gradients travel as they are (bfloat16 is not cast to float16,
whose range is far smaller). Each addition of the sum is formed in float32 and rounded to the
16-bit type once (:mod:`collectives.ring`)."""
from __future__ import annotations

import torch

from .base import CompressionMethod
from .compressor import Compressor
from .payload import Payload
from .schedule import dense_schedule_s
from .threshold import plan_threshold


class SixteenBitCompressor(Compressor):
    """Sends float32 and float64 tensors as ``wire`` (float16 or bfloat16), 16-bit ones as
    they are; ``name``: its name in ``Compression``."""

    def __init__(self, wire: torch.dtype, name: str):
        self.wire, self.name = wire, name

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        if tensor.dtype in (torch.float32, torch.float64):
            return Payload(tensor.to(self.wire), tensor.numel(), tensor.dtype)
        return Payload(tensor, tensor.numel(), tensor.dtype)

    def decode(self, result, payload):
        return result if result.dtype == payload.dtype else result.to(payload.dtype)

    def gather_dtype(self, params):
        """``wire`` for a bucket of float32 or of float64 gradients: the optimizer casts them
        as it gathers them, and ``encode`` sends what it gets (the sum is cast back as it is
        written into the gradients). None for a bucket of mixed dtypes, whose sum is scaled in
        their common dtype."""
        dtypes = {p.dtype for p in params}
        return self.wire if dtypes in ({torch.float32}, {torch.float64}) else None

    def __repr__(self):
        return f"Compression.{self.name}"


class FP16Compressor(SixteenBitCompressor):
    """Horovod's ``Compression.fp16``: float16 on the wire, bfloat16 as it is."""

    def __init__(self):
        super().__init__(torch.float16, "fp16")


class FP16(CompressionMethod):
    def predict(self, case):
        """The default fusion buckets (threshold) with 2 bytes per parameter on the wire."""
        return dense_schedule_s(case, plan_threshold, wire_bytes_per_param=2)


METHOD = FP16("fp16", "float16 on the wire: half the bytes", factory=FP16Compressor())
