"""bfloat16 on the wire (``Compression.bf16``): float32 and float64 gradients travel as bfloat16,
with float32's range and 8 bits of mantissa, where float16 (``Compression.fp16``) keeps 11 bits
but overflows beyond 65504; 16-bit gradients travel as they are. Each addition of the sum is
formed in float32 and rounded to bfloat16 once (:mod:`collectives.ring`)."""
from __future__ import annotations

import torch

from .fp16 import FP16, SixteenBitCompressor

METHOD = FP16("bf16", "bfloat16 on the wire: half the bytes, float32's range",
              factory=SixteenBitCompressor(torch.bfloat16, "bf16"))
