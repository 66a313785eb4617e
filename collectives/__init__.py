"""Torch-free MPI collectives over NumPy buffers: sparse (gTop-k, Top-k AllGather), dense and
merged allreduce, and their alpha-beta cost model. No globals, nothing happens at import."""
from .cost import (AlphaBeta, Calibration, calibrate, gtopk_allreduce_s, ring_allreduce_s,
                   slowest_times, time_collective, topk_allgather_s)
from .dense import allreduce, iallreduce, icast_allreduce
from .errors import HvcommError, check_agree, raise_together
from .handle import Pending
from .merged import BucketPlan, imerged_allreduce, merged_allreduce
from .sparse import (SparseResult, gtopk_allreduce, igtopk_allreduce, index_dtype,
                     itopk_allgather, merge_select, select_topk, topk_allgather)

__all__ = [
    "AlphaBeta", "BucketPlan", "Calibration", "HvcommError", "Pending", "SparseResult",
    "allreduce", "calibrate", "check_agree", "gtopk_allreduce", "gtopk_allreduce_s",
    "iallreduce", "igtopk_allreduce", "icast_allreduce", "imerged_allreduce", "index_dtype", "itopk_allgather",
    "merge_select", "merged_allreduce", "raise_together", "ring_allreduce_s", "select_topk",
    "slowest_times",
    "time_collective", "topk_allgather", "topk_allgather_s",
]
