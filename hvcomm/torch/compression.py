"""Horovod's compression interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress``."""
from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Stateless transform applied to a buffer before communication and undone after."""

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes), summed in float16."""

    def compress(self, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The names Horovod users know: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
