"""PyTorch DDP beside hvcomm in the same MPI job, as a new user of DDP would set it up: the peer
that the benchmarks and the main job compare hvcomm with.

Every MPI rank joins a gloo process group on its own host (an emulated host's address and link,
or loopback on one machine). Methods, each hvcomm's counterpart:

- ``dense``: DDP with its default 25 MiB buckets;
- ``fp16``: DDP's ``fp16_compress_hook``;
- ``powersgd``: DDP's ``powerSGD_hook`` (error feedback, warm start, compressing from its second
  step, where DDP's default waits 1000 steps) on a single bucket: with several buckets the hook
  fails on gloo with a collective mismatch, or deadlocks, as soon as two buckets' hooks run at
  once (torch 2.13, CPU), so it is measured as it works;
- ``post-local-sgd`` (:data:`POST_LOCAL_SGD`, the counterpart of hvcomm's ``LocalSGD``, not a
  gradient method, so not in :data:`METHODS`): DDP's ``post_localSGD_hook`` (gradients
  averaged for ``warmup_steps``, then none: one rank per host) with
  ``PostLocalSGDOptimizer`` and ``PeriodicModelAverager`` (the models averaged at the first
  step after the warm-up and every ``period`` steps from there).
"""
from __future__ import annotations

import ipaddress
import os
import socket

METHODS = ("dense", "fp16", "powersgd")
POST_LOCAL_SGD = "post-local-sgd"
ONE_BUCKET_MB = 1 << 20  # bucket_cap_mb no model reaches


def init_gloo(comm) -> None:
    """Join every rank of ``comm`` (mpi4py) in torch.distributed's default gloo group."""
    import torch.distributed as dist
    host = socket.gethostname()
    try:  # an emulated host (hvcomm.cluster.netem) is named by its address, its link is eth0
        emulated = ipaddress.ip_address(host) in ipaddress.ip_network("198.18.0.0/15")
    except ValueError:
        emulated = False
    addr, iface = (host, "eth0") if emulated else ("127.0.0.1", "lo")
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())


def wrap(model, method: str, rank: int = 4, warmup_steps: int = 0):
    """``model`` in DistributedDataParallel, synchronising its gradients by ``method``
    (post-local SGD: for ``warmup_steps`` steps; wrap the optimizer too, :func:`local_sgd`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    if method not in (*METHODS, POST_LOCAL_SGD):
        raise ValueError(f"unknown DDP method {method!r}; choose one of "
                         f"{(*METHODS, POST_LOCAL_SGD)}")
    if method == POST_LOCAL_SGD:
        ddp = DDP(model)
        state = local.PostLocalSGDState(process_group=None, subgroup=None,
                                        start_localSGD_iter=warmup_steps,
                                        post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, local.post_localSGD_hook)
        ddp.post_local_state = state  # its step count, for a resumed run (resume_local_sgd)
        return ddp
    if method == "powersgd":
        ddp = DDP(model, bucket_cap_mb=ONE_BUCKET_MB)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, use_error_feedback=True,
                                   warm_start=True)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp
    ddp = DDP(model)
    if method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def local_sgd(optimizer, period: int, warmup_steps: int):
    """``optimizer`` as DDP's post-local SGD steps it: ``PostLocalSGDOptimizer`` with a
    ``PeriodicModelAverager`` (``averager.step`` counts the steps)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    return PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=period,
                                                                   warmup_steps=warmup_steps))


def resume_local_sgd(ddp, optimizer) -> None:
    """After ``optimizer.load_state_dict`` (which restores the averager's step): bring the
    gradient hook's own count along, which DDP saves nowhere."""
    state = ddp.post_local_state
    state.iter = min(optimizer.averager.step, state.start_localSGD_iter)


def local_sgd_communicated(step: int, period: int, warmup_steps: int) -> bool:
    """Whether post-local SGD's step ``step`` (from 0) sends the model's bytes: the gradients
    in the warm-up, the weights when the averager averages."""
    return step < warmup_steps or (step - warmup_steps) % period == 0


def payload_bytes(params, method: str, rank: int = 4) -> int:
    """The bytes one rank's allreduces carry per step (before the ring's 2(P-1)/P): PowerSGD's
    P and Q factors of each tensor of two or more dimensions that DDP's hook compresses (more
    than 2x smaller as factors), the rest dense."""
    total = 0
    for p in params:
        n = p.numel()
        if method == "dense":
            total += 4 * n
        elif method == "fp16":
            total += 2 * n
        else:
            rows = p.shape[0] if p.dim() >= 2 else 0
            cols = n // rows if rows else 0
            r = min(rank, rows, cols)
            small = rows and 2 * (rows + cols) * r < n  # DDP's _should_compress
            total += 4 * ((rows + cols) * r if small else n)
    return total


def ring_bytes(nbytes: float, size: int) -> float:
    """What one rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (size - 1) / size * nbytes if size > 1 else 0.0

