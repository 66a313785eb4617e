"""Elastic training on MPI's own fault tolerance: Horovod's ``horovod.torch.elastic`` API with
no driver, no Gloo and no discovery script. Launch as usual, with fault tolerance on::

    mpirun --with-ft ulfm -n 8 python train.py      # Open MPI 5 built with ULFM

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(hvd.elastic.TorchState(model, optimizer, epoch=0))

When a process dies (SIGKILL, a lost node's ranks, an exception that escapes on one rank),
the collective in flight raises :class:`ProcessFailure` (a ``HorovodInternalError``) on
every survivor within seconds (hvcomm revokes its communicators: see
:mod:`hvcomm.torch.fault`). :func:`run` then

1. shrinks the world to the survivors (``MPI_Comm_shrink``, which also makes them agree on
   who failed) and stops if fewer than ``min_np`` are left (a clear error on every survivor);
2. starts hvcomm again on them: engine, watchdog, negotiation, the global process set; every
   DistributedOptimizer gets a new strategy for the new size (the cost fit and plans, gTop-k's
   tree, P3's readiness, the delayed state all start afresh; user process sets are
   dissolved);
3. ``state.restore()``-s the last commit (this rank's own per-rank state included: see
   :mod:`.state`), runs the reset callbacks, ``state.sync()``-s from rank 0, and calls the
   function again.

A second failure, also during a recovery, is survived the same way. Without fault tolerance
(no ``--with-ft ulfm``, or an MPI without ULFM) :func:`run` says so once when it starts, and a
failure ends the job as always.

Growing back is not supported: the job only shrinks (``max_np`` is refused); see
results/elastic.md for why. Losing a whole node is survived while Open MPI's daemon on it
lives (the node's ranks are killed); when the daemon dies too, Open MPI 5's mpirun ends the
job ("PRTE has lost communication with a remote daemon").
"""
from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from typing import Any, Callable, Optional

from collectives.errors import HorovodInternalError, HvcommError, ProcessFailure

from .. import fault
from .. import runtime as _runtime
from ..optimizer import rebuild_all
from .sampler import ElasticSampler
from .state import HostsUpdatedInterrupt, ObjectState, State, TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run", "recoveries"]

recoveries: list = []
"""One dict per recovery in this process: ``detected`` (time.time() when this rank caught the
failure), ``resumed`` (when the survivors had started again, before restore and sync),
``shrink_s``, ``reinit_s``, ``size`` (survivors)."""


def _min_np(min_np: Optional[int]) -> int:
    if min_np is None:
        min_np = int(os.environ.get("HVCOMM_ELASTIC_MIN_NP", 1))
    if min_np < 1:
        raise HvcommError(f"min_np must be at least 1, got {min_np}")
    return min_np


def _is_failure(error: BaseException) -> bool:
    return isinstance(error, ProcessFailure) or fault.is_process_failure(error)


def _reset() -> None:
    """Horovod's reset after a change of hosts (no failure): hvcomm stops and starts again on
    the same world; every DistributedOptimizer keeps its state."""
    _runtime.shutdown()
    _runtime.init()
    rebuild_all(keep_state=True)


def _recover(min_np: int, detected: float) -> None:
    """Shrink to the survivors and start again on them (collective over the survivors)."""
    fault.revoke()  # (where an error every rank raised revealed the failure: not yet done)
    world = _runtime.world()
    _runtime.shutdown()
    fault.untrack_all()                # (also when a failure interrupted init())
    t0 = time.perf_counter()
    survivors = fault.shrink(world)
    shrink_s = time.perf_counter() - t0
    _runtime.continue_on(survivors)
    if survivors.Get_size() < min_np:
        raise HvcommError(f"hvcomm elastic: a process failed and {survivors.Get_size()} are left, "
                          f"fewer than min_np={min_np} (HVCOMM_ELASTIC_MIN_NP); the job stops",
                          everywhere=True)
    t1 = time.perf_counter()
    _runtime.init()
    rebuild_all()
    recoveries.append({"detected": detected, "resumed": time.time(), "shrink_s": shrink_s,
                       "reinit_s": time.perf_counter() - t1, "size": survivors.Get_size()})
    if survivors.Get_rank() == 0:
        print(f"hvcomm elastic: a process failed; going on with {survivors.Get_size()} ranks "
              f"(recovery {len(recoveries)})", file=sys.stderr, flush=True)


def run(func: Optional[Callable] = None, *, min_np: Optional[int] = None,
        max_np: Optional[int] = None):
    """Decorator: run ``func(state, ...)`` and go on after failures, as described in the
    module. ``min_np`` (default env HVCOMM_ELASTIC_MIN_NP, else 1): fewer survivors stop the
    job with an error on each of them. Usable as ``@run`` or ``@run(min_np=2)``."""
    if func is None:
        return functools.partial(run, min_np=min_np, max_np=max_np)
    if max_np is not None:
        raise HvcommError("hvcomm elastic cannot add processes (max_np): the job only shrinks; "
                          "leave max_np out")
    least = _min_np(min_np)

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs) -> Any:
        if not _runtime.is_initialized():
            _runtime.init()
        if not fault.enabled() and _runtime.rank() == 0:
            warnings.warn("hvcomm elastic: this job runs without MPI fault tolerance, so a failed "
                          "process ends it; launch with `mpirun --with-ft ulfm` (Open MPI 5) to "
                          "go on without it", stacklevel=2)
        recovering, resetting, sync, detected = False, False, True, 0.0
        while True:
            try:
                if resetting:  # here, so that a failure during the reset is met below
                    _reset()
                    state.on_reset()
                    resetting = False
                if recovering:
                    with fault.deadline():
                        _recover(least, detected)
                    state.restore()
                    state.on_reset()
                    recovering = False
                if sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                resetting, sync = True, not e.skip_sync
            except Exception as e:  # noqa: BLE001 - only process failures are recovered from
                # every survivor gets here with a failure, or with an error that every rank
                # raises together (which a failure can cause); they agree on which it was
                if not fault.enabled() or not (_is_failure(e) or getattr(e, "everywhere", False)):
                    e.hvcomm_elastic = True  # escaping from here: this rank ends, not the job
                    raise
                detected = time.time()
                if _is_failure(e):
                    fault.revoke()  # (a failure met in this thread): the others stop waiting
                with fault.deadline():
                    failed = fault.failed_in(_runtime.world())
                if not (failed or _is_failure(e)):
                    raise
                recovering, resetting, sync = True, False, True
    return wrapper

