"""Every rank raises at once under ``mpirun --with-ft ulfm``: how often does the job end, and how
often does mpirun hang? With hvcomm's stagger between the ranks' MPI_Abort calls
(hvcomm.torch.ending.ABORT_STAGGER_S) and without it (0 s).

Driver (default): RUNS jobs of P ranks per setting, one at a time, each killed after TIMEOUT s
(a hung prterun ignores SIGTERM); writes results/abort_under_ft.md.
Worker (--worker STAGGER): init, then raise on every rank.
"""
from __future__ import annotations

import argparse
import subprocess
import time

import report
from hvcomm.cluster import launch


def worker(stagger_s: float) -> None:
    import hvcomm.torch as hvd
    from hvcomm.torch import ending
    ending.ABORT_STAGGER_S = stagger_s
    hvd.init()
    raise RuntimeError(f"rank {hvd.rank()} cannot start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", type=float, metavar="STAGGER_S")
    ap.add_argument("-n", "--ranks", type=int, default=3)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=20)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    from hvcomm.torch.ending import ABORT_STAGGER_S
    rows = []
    for stagger in (0.0, ABORT_STAGGER_S):
        ended, hung, walls = 0, 0, []
        for i in range(args.runs):
            cmd = launch.mpirun_cmd(args.ranks, [__file__, "--worker", str(stagger)],
                                    fault_tolerant=True)
            t0 = time.perf_counter()
            try:  # subprocess.run kills with SIGKILL on timeout
                proc = subprocess.run(cmd, env=launch.mpi_env(), capture_output=True,
                                      timeout=args.timeout)
                walls.append(time.perf_counter() - t0)
                outcome = f"exit {proc.returncode} in {walls[-1]:.1f} s"
                ended += proc.returncode != 0  # every rank raised: the job must fail
            except subprocess.TimeoutExpired:
                hung += 1
                outcome = "hung"
            print(f"stagger {stagger} s, run {i + 1}: {outcome}", flush=True)
        rows.append({"stagger between ranks (s)": stagger, "runs": args.runs,
                     "ended non-zero": ended, "ended with exit 0": len(walls) - ended,
                     f"hung (> {args.timeout:g} s)": hung,
                     "median wall of those that ended (s)":
                         f"{sorted(walls)[len(walls) // 2]:.1f}" if walls else "-"})
    text = report.table(rows)
    print("\n" + text)
    path = report.write("abort_under_ft", "Every rank raising at once under MPI fault tolerance",
                        report.setting(P=args.ranks, launcher="mpirun --with-ft ulfm, one node",
                                       job="hvcomm.torch.init(), then raise on every rank"),
                        text)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
