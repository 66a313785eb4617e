"""Dense gradients, sent as they are (Horovod's ``Compression.none``). The simulator's dense
rows are the schedules' (threshold, wfbp, single, merge_rule, mgwfbp)."""
from __future__ import annotations

from .base import CompressionMethod
from .compressor import Compressor
from .payload import Payload


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    sends_as_is = True

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        return Payload(tensor, tensor.numel(), tensor.dtype)

    def decode(self, result, payload):
        return result

    def __repr__(self):
        return "Compression.none"


class Dense(CompressionMethod):
    simulated = False


METHOD = Dense("none", "dense gradients as they are", factory=NoneCompressor())
