"""CD-SGD: OD-SGD's steps sending the gradient compressed (any hvcomm compressor, with its error
feedback), except every k-th delayed step, which sends that step's gradient in full precision:
the k-step correction. The residual stays, to be delivered by the compressed steps; sending it
with the correction as well delivered it in bursts that hurt (0.70 against 0.96 test accuracy
after 8 epochs of the digits job with 2-bit threshold 0.5)."""
from __future__ import annotations

from .request import Request
from .delayed import DelayMethod, delayed_s
from .twobit import TwoBitCompressor


class CDSGD(DelayMethod):
    needs_compressor = True

    def is_full_precision(self, delayed_index, k):
        return (delayed_index + 1) % k == 0

    def predict(self, case):
        """1-byte codes (2-bit quantisation summed as int8) on k-1 of every k steps."""
        return delayed_s(case, coded_bytes_per_param=1, k=case.settings.delay_k)

    def unmodelled(self, case):
        """Its 2-bit codes are summed as int8: at most 127 workers."""
        return TwoBitCompressor().problem(Request(size=case.workers))

    def optimizer_options(self, settings, model=None):
        """With CD-SGD's own compressor, 2-bit codes of threshold 0.5."""
        return {**super().optimizer_options(settings, model),
                "compression": TwoBitCompressor(0.5)}


METHOD = CDSGD("cd-sgd", "delayed allreduce of compressed gradients, full precision every k")
