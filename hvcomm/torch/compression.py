"""``horovod.torch.compression``'s names (``from horovod.torch.compression import Compression``
is common user code); the compressors themselves are methods in :mod:`hvcomm.torch.methods`."""
from .methods import Compression
from .methods.compressor import Compressor
from .methods.fp16 import FP16Compressor
from .methods.none import NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
