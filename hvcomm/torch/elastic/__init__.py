"""Elastic training on MPI's own fault tolerance: Horovod's ``horovod.torch.elastic`` API with
no driver, no Gloo and no discovery script. Launch as usual, with fault tolerance on::

    mpirun --with-ft ulfm -n 8 python train.py      # Open MPI 5 built with ULFM

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(hvd.elastic.TorchState(model, optimizer, epoch=0))

When a process dies (SIGKILL, a lost node's ranks), the collective in flight raises
:class:`ProcessFailure` (a ``HorovodInternalError``) on every survivor within seconds (hvcomm
revokes its communicators: see :mod:`hvcomm.torch.fault`). The survivors then agree
(``MPI_Comm_agree``) whether a process of the job has failed; only then does :func:`run`

1. shrink the world to the survivors (``MPI_Comm_shrink``, which also makes them agree on
   who failed) and stop if fewer than ``min_np`` are left, or if the job has been reset
   ``reset_limit`` times already (a clear error on every survivor, a failed job);
2. start hvcomm again on them: engine, watchdog, negotiation, the global process set; every
   DistributedOptimizer gets a new strategy for the new size (the cost fit and plans, gTop-k's
   tree, P3's readiness, the delayed state all start afresh; user process sets are
   dissolved);
3. restore the newest commit that every survivor has (this rank's own per-rank state
   included: see :mod:`.state`), run the reset callbacks, ``state.sync()`` from rank 0 (the
   step counter and global weights too), and call the function again.

A second failure, also during a recovery, is survived the same way. Any other exception
(a bug, a bad batch) ends the whole job with a non-zero status and its message, whichever
ranks raise it (``on_exception="leave"`` makes the raising rank leave as a failed process
instead, and the others go on). Without fault tolerance (no ``--with-ft ulfm``, or an MPI
without ULFM) :func:`run` says so once when it starts, and a failure ends the job as always.

Growing back is not supported: the job only shrinks (``max_np`` is refused); see
results/elastic.md for why. The ranks of a node can be lost while Open MPI's daemon on it
lives; when the daemon dies too (a node crash), Open MPI 5's mpirun ends the job ("PRTE has
lost communication with a remote daemon") without a completion record, and the launcher
reports a failure (:mod:`hvcomm.cluster.outcome`). That is survived by a relaunch on the nodes
left (slurm/ethernet.sbatch with ELASTIC=1): with ``HVCOMM_ELASTIC_SAVE_EVERY`` the ranks save
their commits to disk, and :func:`run` starts from the newest one every rank has (see
:mod:`.state`).
"""
from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from typing import Any, Callable, Optional, Tuple

from collectives.errors import HvcommError

from .. import ending, fault
from .. import runtime as _runtime
from ..checkpoint import newest_in_all
from ..exchange_ops import allgather_object
from ..optimizer import rebuild_all
from .sampler import ElasticSampler
from .state import KEEP_COMMITS, HostsUpdatedInterrupt, ObjectState, State, saved_on_disk
from .torch_state import TorchState

HorovodInternalError = HvcommError  # Horovod's name for the error its collectives raise

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run", "recoveries"]

recoveries: list = []
"""One dict per recovery in this process: ``detected`` (time.time() when this rank caught the
failure), ``resumed`` (when the survivors had started again, before restore and sync),
``shrink_s``, ``reinit_s``, ``size`` (survivors)."""


ON_EXCEPTION = ("abort", "leave")
# run()'s settings, each an argument or else an environment variable (default)
SETTINGS = (("min_np", "HVCOMM_ELASTIC_MIN_NP", "1"),
            ("reset_limit", "HVCOMM_ELASTIC_RESET_LIMIT", ""),
            ("on_exception", "HVCOMM_ELASTIC_ON_EXCEPTION", "abort"))
ON_DISK = ("HVCOMM_ELASTIC_SAVE_EVERY", "HVCOMM_CHECKPOINT_DIR")  # read by .state


def _settings(given: dict) -> Tuple[int, Optional[int], bool]:
    """COLLECTIVE: (min_np, reset_limit, whether an exception makes its rank leave), from
    run()'s arguments or the environment, which a launcher may not have given every host:
    every rank reads the same, and at least min_np ranks run, else every rank raises."""
    raw = {name: str(given[name]) if given[name] is not None else os.environ.get(env, default)
           for name, env, default in SETTINGS}
    raw.update((env, os.environ.get(env, "")) for env in ON_DISK)
    every = allgather_object(raw)
    differ = sorted({k for r in every for k in r if r[k] != raw[k]})
    if differ:
        seen = {k: sorted({r[k] for r in every}) for k in differ}
        raise HvcommError(
            f"hvcomm elastic: the ranks disagree on {seen}; pass the settings to run() in the "
            "script, or export the HVCOMM_ELASTIC_* variables to every host (mpirun -x VAR)",
            everywhere=True)

    def whole(name: str, least: int) -> Optional[int]:
        value = raw[name]
        if value == "":
            return None
        if not value.lstrip("-").isdigit() or int(value) < least:
            raise HvcommError(f"hvcomm elastic: {name} must be a whole number of at least "
                              f"{least}, got {value!r}", everywhere=True)
        return int(value)

    min_np, reset_limit = whole("min_np", 1), whole("reset_limit", 0)
    if raw["on_exception"] not in ON_EXCEPTION:
        raise HvcommError(f"hvcomm elastic: on_exception must be one of {ON_EXCEPTION}, got "
                          f"{raw['on_exception']!r}", everywhere=True)
    if _runtime.size() < min_np:
        raise HvcommError(f"hvcomm elastic: the job starts on {_runtime.size()} ranks, fewer "
                          f"than min_np={min_np} (HVCOMM_ELASTIC_MIN_NP); the job stops",
                          everywhere=True)
    return min_np, reset_limit, raw["on_exception"] == "leave"


_resumed_from_disk = False  # elastic state on disk is for the job's start, once per process


def _resume_from_disk(state: State) -> None:
    """COLLECTIVE, at the first run() of the process: go on from the elastic state on disk
    (a relaunch after a lost node), where there is one."""
    global _resumed_from_disk
    if _resumed_from_disk or not isinstance(state, ObjectState):
        return
    _resumed_from_disk = True
    resumed = state.resume_from_disk()
    if resumed is not None:
        if _runtime.rank() == 0:
            print(f"hvcomm elastic: resumed from commit {resumed} on disk "
                  f"({saved_on_disk()[0]}) on {_runtime.size()} ranks",
                  file=sys.stderr, flush=True)
        state.on_reset()  # a relaunch is a reset: the callbacks see the new size


def _reset() -> None:
    """Horovod's reset after a change of hosts (no failure): hvcomm stops and starts again on
    the same world; every DistributedOptimizer keeps its state."""
    _runtime.shutdown()
    _runtime.init()
    rebuild_all(keep_state=True)


def _recover(min_np: int, reset_limit: Optional[int], resets: int, detected: float) -> None:
    """Shrink to the survivors and start again on them (collective over the survivors):
    ``resets`` counts this one."""
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
    _check_reset_limit(reset_limit, resets)
    t1 = time.perf_counter()
    _runtime.init()
    rebuild_all()
    recoveries.append({"detected": detected, "resumed": time.time(), "shrink_s": shrink_s,
                       "reinit_s": time.perf_counter() - t1, "size": survivors.Get_size()})
    if survivors.Get_rank() == 0:
        print(f"hvcomm elastic: a process failed; going on with {survivors.Get_size()} ranks "
              f"(recovery {len(recoveries)})", file=sys.stderr, flush=True)


def _restore_agreed_commit(state: State) -> None:
    """COLLECTIVE over the survivors: restore the newest commit that every one of them has
    whole (they can be a commit apart: a collective can complete on some ranks and fail on
    others, and a failure can interrupt a save)."""
    if not isinstance(state, ObjectState):  # a user's State: its own restore(), one copy
        state.restore()
        return
    every = allgather_object(sorted(state.kept_commits()))
    commit_id = newest_in_all(every)
    if commit_id is None:
        raise HvcommError(f"hvcomm elastic: the survivors keep no commit in common (each keeps "
                          f"its {KEEP_COMMITS} newest: {every}); the job stops", everywhere=True)
    state.restore(commit_id)


def _check_reset_limit(reset_limit: Optional[int], resets: int) -> None:
    if reset_limit is not None and resets > reset_limit:
        raise HvcommError(f"hvcomm elastic: reset {resets} would exceed reset_limit={reset_limit} "
                          "(HVCOMM_ELASTIC_RESET_LIMIT); the job stops", everywhere=True)


def run(func: Optional[Callable] = None, *, min_np: Optional[int] = None,
        max_np: Optional[int] = None, reset_limit: Optional[int] = None,
        on_exception: Optional[str] = None):
    """Decorator: run ``func(state, ...)`` and go on after failures, as described in the
    module. Usable as ``@run`` or ``@run(min_np=2)``.

    - ``min_np`` (default env HVCOMM_ELASTIC_MIN_NP, else 1): fewer survivors stop the job.
    - ``reset_limit`` (Horovod's name; default env HVCOMM_ELASTIC_RESET_LIMIT, else none):
      the job stops at the reset (a recovery or a change of hosts) after this many. Counted
      per launch: a relaunch (slurm/common.sh) starts counting again.
    - ``on_exception`` (default env HVCOMM_ELASTIC_ON_EXCEPTION, else ``"abort"``): what an
      exception other than a process failure does: ``"abort"`` ends the whole job with an error;
      ``"leave"`` ends the raising rank as a failed process and the others go on.

    The ranks must agree on these and on the elastic state on disk (``HVCOMM_ELASTIC_SAVE_EVERY``,
    ``HVCOMM_CHECKPOINT_DIR``): checked, with the values, when the function starts.
    """
    if func is None:
        return functools.partial(run, min_np=min_np, max_np=max_np, reset_limit=reset_limit,
                                 on_exception=on_exception)
    if max_np is not None:
        raise HvcommError("hvcomm elastic cannot add processes (max_np): the job only shrinks; "
                          "leave max_np out")
    given = {"min_np": min_np, "reset_limit": reset_limit, "on_exception": on_exception}

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs) -> Any:
        if not _runtime.is_initialized():
            _runtime.init()
        if not fault.enabled() and _runtime.rank() == 0:
            warnings.warn("hvcomm elastic: this job runs without MPI fault tolerance, so a failed "
                          "process ends it; launch with `mpirun --with-ft ulfm` (Open MPI 5) to "
                          "go on without it", stacklevel=2)
        least, limit, leave = _settings(given)
        _resume_from_disk(state)
        recovering, resetting, sync, detected, resets = False, False, True, 0.0, 0
        while True:
            try:
                if resetting:  # here, so that a failure during the reset is met below
                    _check_reset_limit(limit, resets)
                    _reset()
                    state.on_reset()
                    resetting = False
                if recovering:
                    with fault.deadline():
                        _recover(least, limit, resets, detected)
                    ending.watch_system_exit()  # this process will end without MPI_Finalize
                    _restore_agreed_commit(state)
                    state.on_reset()
                    recovering = False
                if sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                resetting, sync, resets = True, not e.skip_sync, resets + 1
            except Exception as e:  # noqa: BLE001 - only process failures are recovered from
                # every survivor gets here with a failure, or with an error that every rank
                # raises together (which a failure can cause); they agree on which it was
                lost = fault.lost_a_process(e)
                if not fault.enabled() or not (lost or getattr(e, "everywhere", False)):
                    e.hvcomm_leave = leave  # escaping: ends the job (or this rank: "leave")
                    raise
                detected = time.time()
                if lost:
                    fault.revoke()  # (a failure met in this thread): the others stop waiting
                with fault.deadline():
                    failed = fault.failed_in(_runtime.world())
                if not failed:
                    if lost:
                        raise HvcommError(f"hvcomm elastic: MPI reported an error that looked "
                                          f"like a process failure ({e}), but no process of "
                                          "the job has failed; the job stops") from e
                    raise
                recovering, resetting, sync, resets = True, False, True, resets + 1
    return wrapper
