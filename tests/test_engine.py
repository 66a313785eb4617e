"""The engine's collectives in flight together, with stand-ins for the collectives (no MPI job):
at most two started at once, on alternating tags; a job that cannot be started waits for
them; every job finishes in submission order, a start that raises too.

Whether the engine wrongly calls something early is looked at after a pause: a correct engine
never fails these checks, however slow the machine."""
import threading
import time

import pytest

from hvcomm.torch.engine import IN_FLIGHT, START_TAGS, Engine

PAUSE_S = 0.2  # time for an engine to do what it must not
GATES = []  # every Gate made: opened before the engine is closed, also after a failed check


class Gate:
    """Stands in for a started collective (a collectives.handle.Pending): finished once
    opened, its result ``value``."""

    def __init__(self, value):
        self.value, self.rounds, self.opened = value, 0, threading.Event()
        GATES.append(self)

    def test(self) -> bool:
        return self.opened.is_set()

    def wait(self):
        return self.value


@pytest.fixture
def engine():
    e = Engine(comm="engine's comm")
    yield e
    for gate in GATES:
        gate.opened.set()
    GATES.clear()
    e.close()


def starter(gates, calls, i):
    def start(comm, tag):
        assert comm == "engine's comm"
        calls.append((i, tag))
        return gates[i]
    return start


def not_run(comm):
    raise AssertionError("a started job's own run() was called")


def wait_for(predicate, what):
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_two_in_flight_on_their_tags_finished_in_order(engine):
    assert IN_FLIGHT == 2 and len(set(START_TAGS)) == 2
    gates, calls = [Gate(f"sum {i}") for i in range(3)], []
    handles = [engine.submit(not_run, start=starter(gates, calls, i)) for i in range(3)]
    wait_for(lambda: len(calls) == 2, "the second job was not started beside the first")
    time.sleep(PAUSE_S)
    assert calls == [(0, START_TAGS[0]), (1, START_TAGS[1])], "a third started too early"
    gates[1].opened.set()  # the younger ends first: nothing finishes before the older
    time.sleep(PAUSE_S)
    assert not any(h.done() for h in handles) and len(calls) == 2
    gates[0].opened.set()
    assert [handles[0].wait(), handles[1].wait()] == ["sum 0", "sum 1"]
    wait_for(lambda: len(calls) == 3, "the third job was not started")
    assert calls[2] == (2, START_TAGS[0])  # the first's tag, free again
    gates[2].opened.set()
    assert handles[2].wait() == "sum 2"


def test_a_job_that_cannot_be_started_waits_for_those_in_flight(engine):
    gates, calls, ran = [Gate("started")], [], threading.Event()

    def blocking(comm):
        ran.set()
        return "ran"
    first = engine.submit(not_run, start=starter(gates, calls, 0))
    unstartable = engine.submit(blocking, start=lambda comm, tag: None)  # runs as a job
    plain = engine.submit(lambda comm: "plain")
    time.sleep(PAUSE_S)
    assert calls == [(0, START_TAGS[0])] and not ran.is_set() and not plain.done()
    gates[0].opened.set()
    assert [first.wait(), unstartable.wait(), plain.wait()] == ["started", "ran", "plain"]


def test_a_start_that_raises_fails_its_job_in_order(engine):
    gates, calls = [Gate("first"), None, Gate("third")], []

    def bad_start(comm, tag):
        calls.append((1, tag))
        raise ValueError("no such buffer")
    first = engine.submit(not_run, start=starter(gates, calls, 0))
    bad = engine.submit(not_run, start=bad_start)
    time.sleep(PAUSE_S)
    assert not bad.done()  # its failure waits for the job before it
    gates[0].opened.set()
    assert first.wait() == "first"
    with pytest.raises(ValueError, match="no such buffer"):
        bad.wait()
    third = engine.submit(not_run, start=starter(gates, calls, 2))
    gates[2].opened.set()
    assert third.wait() == "third"
    assert [tag for _, tag in calls] == [START_TAGS[0], START_TAGS[1], START_TAGS[0]]


class Watchdog:
    """Stands in for hvcomm.torch.watchdog.Watchdog: what the other ranks said, and what this
    one announced."""

    def __init__(self):
        self.peer_problem, self.peer_problem_at, self.announced = None, 0.0, []

    def announce(self, kind, text):
        self.announced.append((kind, text))


def test_failures_are_announced_when_found_and_problems_outlive_older_jobs(engine):
    wd = engine.watchdog = Watchdog()
    gates, calls = [Gate("older")], []

    def bad_start(comm, tag):
        raise ValueError("no such buffer")
    older = engine.submit(not_run, start=starter(gates, calls, 0))
    bad = engine.submit(not_run, start=bad_start)
    wait_for(lambda: wd.announced, "the failure was not announced while the older job ran")
    assert wd.announced[0][0] == "failed" and "no such buffer" in wd.announced[0][1]
    assert not bad.done()
    wd.peer_problem, wd.peer_problem_at = "rank 1 failed in it", time.monotonic()
    gates[0].opened.set()
    wait_for(older.done, "the older job did not finish")  # (wait() would see the problem)
    assert older.wait() == "older"
    assert wd.peer_problem == "rank 1 failed in it"  # heard of after the older job began
    with pytest.raises(ValueError):
        bad.wait()
    later = engine.submit(lambda comm: "later")
    wait_for(later.done, "the later job did not finish")
    assert later.wait() == "later" and wd.peer_problem is None  # begun after it: over
