"""hvcomm: communication-efficient data-parallel training (Horovod-compatible, on mpi4py).

``hvcomm.torch`` is the drop-in for ``horovod.torch``; ``hvcomm.Compression`` is
``hvcomm.torch.Compression`` (imported on first use, so ``import hvcomm`` stays light).
"""


def __getattr__(name):
    if name == "Compression":
        from .torch.methods import Compression
        return Compression
    raise AttributeError(f"module 'hvcomm' has no attribute {name!r}")
