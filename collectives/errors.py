"""One error family for the collectives and hvcomm, and the collective check that makes every
rank raise together. (Horovod's name for it, ``HorovodInternalError``, lives in hvcomm.torch.)
Also the reading of the collectives' numeric environment settings."""
from __future__ import annotations

import os
from typing import Any, Callable, Hashable, Optional, Sequence


class HvcommError(RuntimeError, ValueError):
    """Bad input or a disagreement between ranks; the message says what to do. A
    RuntimeError, as a failed collective is, and a ValueError, as bad arguments are.
    ``everywhere``: every rank raises it together (the ranks stay in step)."""

    def __init__(self, *args, everywhere: bool = False):
        super().__init__(*args)
        self.everywhere = everywhere


class ProcessFailure(HvcommError):
    """A process of the job failed: the collective in flight cannot finish. Raised on every
    surviving rank; :func:`hvcomm.torch.elastic.run` recovers from it."""


def raise_together(comm, local_error: Optional[str], what: str) -> None:
    """Raise HvcommError on every rank of ``comm`` if any rank reports an error.

    Each rank passes the text of its own problem, or None. One small allgather decides,
    so a rank with a bad argument cannot leave the others waiting in the next collective.
    """
    errors = [local_error] if comm is None or comm.Get_size() == 1 else comm.allgather(local_error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise HvcommError(f"{what}: {detail}", everywhere=True)


def check_agree(comm, key: Hashable, what: str, local_error: Optional[str] = None) -> None:
    """Raise on every rank unless all ranks pass an equal ``key`` (and no rank an error)."""
    raise_together(comm, local_error, what)
    if comm is None or comm.Get_size() == 1:
        return
    keys: Sequence[Any] = comm.allgather(key)
    if any(k != keys[0] for k in keys):
        listing = "; ".join(f"rank {r}: {k!r}" for r, k in enumerate(keys))
        raise HvcommError(f"{what}: ranks disagree ({listing}); every rank must pass the same",
                          everywhere=True)


def env_number(name: str, default: Any, unit: str, low: float, high: Optional[float] = None,
               parse: Callable[[str], Any] = float) -> Any:
    """The setting in environment variable ``name``, ``parse``d (``default`` when unset);
    HvcommError, naming the variable, its ``unit`` and range, unless it is a number from
    ``low`` to ``high`` (no upper bound if None)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not (low <= value and (high is None or value <= high)):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise HvcommError(f"{name} must be {unit} {bounds}, got {text!r}; unset it for the "
                          f"default ({default})")
    return value
