"""hvcomm.torch: a drop-in for ``horovod.torch`` (same names), on mpi4py."""
from collectives.errors import HvcommError

from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                       grouped_allreduce, grouped_reducescatter, reducescatter)
from .methods.compression import Compression, Compressor
from .methods.delayed import Delay
from .functions import broadcast_optimizer_state, broadcast_parameters
from .gather_ops import (allgather_async, allgather_object, alltoall_async, barrier,
                         broadcast_, broadcast_async, broadcast_async_, broadcast_object,
                         grouped_allgather_async, grouped_reducescatter_async,
                         reducescatter_async, sparse_allreduce_async)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allreduce_, allreduce_async,
                  allreduce_async_, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, join, poll, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .runtime import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, init, is_initialized, local_rank, local_size, mpi_built,
                      mpi_comm, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                      rocm_built, shutdown, size, start_timeline)
from .sync_batch_norm import SyncBatchNorm
from .timeline import stop_timeline

HorovodInternalError = HvcommError  # Horovod's name for the error its collectives raise

__all__ = [name for name in dir() if not name.startswith("_")]
