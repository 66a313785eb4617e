"""hvcomm.torch: a drop-in for ``horovod.torch`` (same names), on mpi4py."""
from .compression import Compression, Compressor
from .delayed import Delay
from .functions import broadcast_optimizer_state, broadcast_parameters
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                  allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                  barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                  broadcast_object, join, poll, synchronize)
from .optimizer import DistributedOptimizer
from .runtime import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                      mpi_comm, rank, shutdown, size, start_timeline)
from .timeline import stop_timeline

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "Delay", "DistributedOptimizer", "Max", "Min",
    "Product", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "cross_rank", "start_timeline", "stop_timeline", "cross_size", "init", "is_initialized", "join",
    "local_rank", "local_size", "mpi_comm", "poll", "rank", "shutdown", "size", "synchronize",
]
