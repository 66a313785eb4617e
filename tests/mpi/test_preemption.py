"""hvcomm.torch.preemption on every rank: the handlers only set a flag, and requested() is True
on every rank as soon as one rank has the signal (here: only the last rank signals itself)."""
import signal
import threading

import pytest
from mpi4py import MPI

import hvcomm.torch as hvd
from hvcomm.torch import preemption


def raise_in_main_thread(sig):
    """The signal to this thread (not to the process, which any of MPI's threads could take):
    pthread_kill runs the Python handler before it returns."""
    signal.pthread_kill(threading.main_thread().ident, sig)


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(autouse=True)
def clean():
    preemption.uninstall()
    yield
    preemption.uninstall()


def test_requested_before_install_is_an_error():
    with pytest.raises(RuntimeError, match="before preemption.install"):
        preemption.requested()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_one_rank_signalled_stops_every_rank(sig):
    r, n = hvd.rank(), hvd.size()
    assert n == MPI.COMM_WORLD.Get_size()
    preemption.install()
    assert not preemption.requested() and not preemption.signalled()
    if r == n - 1:
        raise_in_main_thread(sig)
        assert preemption.signalled() and preemption.received() == sig
    assert preemption.requested()  # every rank, the unsignalled ones included
    assert preemption.signalled() == (r == n - 1)
    assert preemption.received() == (sig if r == n - 1 else None)
    assert preemption.requested()  # the flag stays set: asked again, the same answer
    # the process is still alive: the default action (termination) was replaced
    assert MPI.COMM_WORLD.allreduce(1) == n


def test_install_is_idempotent_and_uninstall_restores():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        preemption.install()
        preemption.install([signal.SIGUSR1])  # again: still the first previous handler kept
        assert preemption.installed()
        raise_in_main_thread(signal.SIGUSR1)
        assert preemption.signalled() and not seen
        preemption.uninstall()
        assert not preemption.installed() and not preemption.signalled()
        raise_in_main_thread(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_misuse():
    with pytest.raises(ValueError, match="cannot be caught"):
        preemption.install([signal.SIGKILL])
    assert not preemption.installed()  # nothing half-installed
    with pytest.raises(ValueError, match="no signal"):
        preemption.install([])
