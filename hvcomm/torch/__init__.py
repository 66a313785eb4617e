"""hvcomm.torch: a drop-in for ``horovod.torch`` (same names), on mpi4py.

The names load on first use (PEP 562), so that ``hvcomm.torch.methods``, which the simulator
and the advisor read, imports without an MPI library; ``import hvcomm.torch as hvd`` then
``hvd.init()`` works as in Horovod.
"""
from collectives import lazy_names

_EXPORTS = {
    ".autograd": ("allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
                  "grouped_allreduce", "grouped_reducescatter", "reducescatter"),
    ".methods": ("Compression",),
    ".methods.compressor": ("Compressor",),
    ".methods.delayed": ("Delay",),
    ".methods.local_sgd": ("LocalSGD",),
    ".methods.diloco": ("DiLoCo",),
    ".functions": ("broadcast_optimizer_state", "broadcast_parameters"),
    ".exchange_ops": ("allgather_async", "allgather_object", "alltoall_async", "barrier",
                      "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
                      "grouped_allgather_async", "grouped_reducescatter_async",
                      "reducescatter_async", "sparse_allreduce_async"),
    ".ops": ("Adasum", "Average", "Max", "Min", "Product", "Sum", "allreduce_",
             "allreduce_async", "allreduce_async_", "grouped_allreduce_",
             "grouped_allreduce_async", "grouped_allreduce_async_", "join", "poll",
             "synchronize"),
    ".optimizer": ("DistributedOptimizer",),
    ".process_sets": ("ProcessSet", "add_process_set", "global_process_set",
                      "remove_process_set"),
    ".runtime": ("ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
                 "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank",
                 "local_size", "mpi_built", "mpi_comm", "mpi_enabled", "mpi_threads_supported",
                 "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline"),
    ".sync_batch_norm": ("SyncBatchNorm",),
    ".timeline": ("stop_timeline",),
}
__all__ = lazy_names(__name__, globals(), _EXPORTS, {
    "HvcommError": ("collectives.errors", "HvcommError"),
    "HorovodInternalError": (".elastic", "HorovodInternalError"),  # HvcommError
    "ProcessFailure": ("collectives.errors", "ProcessFailure"),
    "HostsUpdatedInterrupt": (".elastic", "HostsUpdatedInterrupt")})
