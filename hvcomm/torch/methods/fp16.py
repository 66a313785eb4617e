"""float16 on the wire (Horovod's ``Compression.fp16``): half the bytes; the sums are added in
float32 and rounded to float16 once (:func:`collectives.dense.icast_allreduce`)."""
from __future__ import annotations

import dataclasses

import torch

from .base import Compressor, CompressionMethod, Payload
from .schedule import dense_schedule_s
from .threshold import plan_threshold


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16."""

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return Payload(tensor.to(torch.float16), tensor.numel(), tensor.dtype)
        return Payload(tensor, tensor.numel(), tensor.dtype)

    def decode(self, result, payload):
        return result if result.dtype == payload.dtype else result.to(payload.dtype)

    def __repr__(self):
        return "Compression.fp16"


class FP16(CompressionMethod):
    def predict(self, case):
        """The default fusion buckets (threshold) with 2 bytes per parameter."""
        half = dataclasses.replace(case, trace=dataclasses.replace(case.trace, bytes_per_param=2))
        return dense_schedule_s(half, plan_threshold)


METHOD = FP16("fp16", "float16 on the wire: half the bytes", factory=FP16Compressor())
