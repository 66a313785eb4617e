"""The job's own record of how it ended, so that a launcher never reports a failed job as done.

``mpirun`` can exit 0 after ranks died (under ``--with-ft ulfm``, or when a node's daemon is
lost), so its exit status alone cannot say whether training finished. A launcher sets
``HVCOMM_OUTCOME_FILE`` (forwarded to every host); the job's ranks then write it
(:mod:`hvcomm.torch.ending`):

- ``{"outcome": "completed", ...}``: rank 0 of the final world, after every rank has ended its
  program with status 0;
- ``{"outcome": "failed", "error": ..., ...}``: a rank that aborts the job (an uncaught
  exception), first; else rank 0 of the final world, when a rank ended with a non-zero status
  (every rank stopping with one error: too few survivors, the reset limit), a process failed
  as the ranks ended, or not every rank ended within ``HVCOMM_EXIT_DEADLINE_S``.

:func:`verdict` turns the launcher's exit status and the record into the job's status;
``python -m hvcomm.cluster.outcome FILE RC`` prints it and exits with it (slurm/common.sh).
Torch-free: the launchers import it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Tuple, Union

from .. import durable

ENV = "HVCOMM_OUTCOME_FILE"
COMPLETED, FAILED = "completed", "failed"


def requested() -> Optional[Path]:
    """Where this job must write its outcome, or None when no launcher asked for one."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write(path: Union[str, Path], outcome: str, **fields) -> None:
    """Write the record atomically (a reader sees a whole record or none) and durably
    (:mod:`hvcomm.durable`: a node that crashes next does not lose it)."""
    if outcome not in (COMPLETED, FAILED):
        raise ValueError(f"outcome must be {COMPLETED!r} or {FAILED!r}, got {outcome!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"outcome": outcome, "time": time.time(), **fields}
    text = (json.dumps(record) + "\n").encode()
    durable.write(path, lambda f: f.write(text))


def read(path: Union[str, Path]) -> Optional[dict]:
    """The record, or None when there is none (or it cannot be read)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def verdict(path: Union[str, Path], launcher_status: int) -> Tuple[int, str]:
    """The job's exit status and a sentence saying why: the launcher's status when it is not 0,
    else 0 only when the job recorded that it completed."""
    record = read(path)
    if launcher_status != 0:
        why = f": {record['error']}" if record and record.get("error") else ""
        return launcher_status, f"the launcher exited {launcher_status}{why}"
    if record is None:
        return 1, (f"the launcher exited 0 but the job wrote no outcome to {path}: a rank or a "
                   "node was lost, or the script ended before hvcomm.torch.init(); the job failed")
    if record.get("outcome") == COMPLETED:
        return 0, f"completed on {record.get('size', '?')} ranks"
    return 1, f"the job failed: {record.get('error', 'no reason recorded')}"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].lstrip("-").isdigit():
        print("usage: python -m hvcomm.cluster.outcome OUTCOME_FILE LAUNCHER_EXIT_STATUS",
              file=sys.stderr)
        return 2
    status, why = verdict(args[0], int(args[1]))
    print(f"hvcomm: {why} (exit {status})", file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
