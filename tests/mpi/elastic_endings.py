"""How an elastic job ends, for tests/test_elastic.py: ``elastic_endings.py MODE``.

- ``bug:all`` / ``bug:0``: a ValueError inside ``elastic.run`` at step 2, on every rank or on
  rank 0 alone (the job must end with an error);
- ``survive:HOW``: world rank 2 is SIGKILLed at step 2, the others finish and then end with
  HOW: ``raise`` (``raise SystemExit(3)``), ``exit`` (the built-in ``exit(4)``), ``hook`` (an
  uncaught KeyError under a replaced ``sys.excepthook``), ``caught`` (``sys.exit(5)`` caught
  at the top level, then a normal end); each survivor leaves an unflushed line in
  OUT_DIR/log.rank<R>; the top level runs ``main`` in a try/except/finally, so each SystemExit
  leaves through a ``finally``;
- ``limit``: world ranks 0 and 1 are SIGKILLed at steps 1 and 3 with ``reset_limit=1`` (the
  outcome is then recorded by world rank 2, rank 0 of the last survivors);
- ``disagree``: rank 0 asks for ``min_np=1``, the others for 2;
- ``few``: every rank asks for ``min_np=4`` (the job has 3);
- ``vanish``: every rank ends at once after ``hvcomm.torch.init()``, with ``os._exit(0)``.
"""
import os
import signal
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import hvcomm.torch as hvd

WORLD_RANK = MPI.COMM_WORLD.Get_rank()


def main(mode: str, out: Path) -> None:
    kind, _, arg = mode.partition(":")
    hvd.init()
    expect = os.environ.get("HVCOMM_TEST_EXPECT_SIZE")
    if expect and int(expect) != hvd.size():
        raise SystemExit(f"expected {expect} ranks, mpirun started {hvd.size()}")
    if kind == "vanish":
        hvd.barrier()  # rank 0 has dealt with the outcome record by now
        os._exit(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)
    kills = {"survive": {2: 2}, "limit": {1: 0, 3: 1}}.get(kind, {})  # step: world rank
    settings = {"limit": {"reset_limit": 1}, "few": {"min_np": 4},
                "disagree": {"min_np": 1 if WORLD_RANK == 0 else 2}}.get(kind, {})
    log = open(out / f"log.rank{WORLD_RANK}", "w")

    @hvd.elastic.run(**settings)
    def train(state):
        for state.step in range(state.step, 6):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            if kills.get(state.step) == WORLD_RANK:
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "bug" and state.step == 2 and arg in ("all", str(hvd.rank())):
                raise ValueError(f"bug on rank {hvd.rank()}")
            opt.step()
            state.commit()

    train(state)
    log.write(f"rank {WORLD_RANK} ended training with {hvd.size()} ranks\n")  # left buffered
    if kind != "survive":
        return
    if arg == "raise":
        raise SystemExit(3)
    if arg == "exit":
        exit(4)  # noqa: PLR1722 - the built-in, as a script would call it
    if arg == "hook":
        sys.excepthook = lambda *exc: sys.stderr.write(f"my hook: {exc[1]!r}\n")
        raise KeyError("after the hook")
    if arg == "caught":
        sys.exit(5)


if __name__ == "__main__":
    try:
        main(sys.argv[1], Path(sys.argv[2]))
    except SystemExit as leaving:
        if leaving.code != 5:  # "caught": the program ends normally
            raise
    finally:
        ENDED = True  # a line that runs while the SystemExit leaves
