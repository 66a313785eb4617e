"""hvcomm's ring over Open MPI's messages against the ring over its own TCP links
(``HVCOMM_RING_TRANSPORT=mpi`` / ``tcp``), by chunk size: the defaults of
``collectives.ring.CHUNK_BYTES``.

In one job per (network, P), alternating calls of ``collectives.ring.ring_allreduce`` on the
dense gradient of scripts/bench_ddp.py's model (25,616,000 float32, 102.5 MB), torch's
additions as hvcomm.torch runs it, for each transport and chunk size. Each figure is the median
over rounds of the slowest rank's time, and a rank's process CPU time over the call (all its
threads, the mean over ranks). Writes results/ring_transport.md with the ring's transfer bound.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import report

ELEMENTS = 25_616_000  # scripts/bench_ddp.py's 10 x Linear(1600, 1600)
TRANSPORTS = ("mpi", "tcp")


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from collectives.ring import ring_allreduce
    from hvcomm.torch.sums import add_torch

    comm = MPI.COMM_WORLD
    x = np.full(ELEMENTS, 2.0 ** -30, np.float32)  # summed in place call after call: stays finite
    cases = [(t, c) for c in args.chunks for t in TRANSPORTS]
    times = {case: [] for case in cases}
    cpu = {case: [] for case in cases}
    for round_ in range(args.rounds + 1):  # the first round warms up (links, workspaces)
        for transport, chunk in cases:
            os.environ["HVCOMM_RING_TRANSPORT"] = transport
            comm.Barrier()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            ring_allreduce(comm, x, add=add_torch, chunk_bytes=chunk, check=False)
            wall, used = time.perf_counter() - wall0, time.process_time() - cpu0
            wall, used = comm.allreduce(wall, op=MPI.MAX), comm.allreduce(used) / comm.size
            if round_:
                times[(transport, chunk)].append(wall)
                cpu[(transport, chunk)].append(used)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(
            [{"transport": t, "chunk (KiB)": c >> 10, "ring (s)": statistics.median(times[(t, c)]),
              "runs (s)": f"{min(times[(t, c)]):.3f}-{max(times[(t, c)]):.3f}",
              "CPU (s)": statistics.median(cpu[(t, c)])} for t, c in cases]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nets", nargs="+", default=["shm", "1gbit", "10gbit"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1 << 20, 4 << 20],
                    help="chunk sizes in bytes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    tmp = Path(tempfile.mkdtemp(prefix="hvcomm-transport-"))
    rows, labels = [], {}
    for asked in args.nets:
        net, labels[asked] = report.resolve_net(asked)
        for p in args.ranks:
            res = report.run_worker(p, [__file__, "--worker", "--rounds", str(args.rounds),
                                        "--chunks", *map(str, args.chunks)],
                                    timeout=3000, out=tmp / f"{net}-{p}.json", net=net)
            bound = None if net == "shm" else \
                2 * (p - 1) / p * ELEMENTS * 4 * 8 / report.parse_rate_bit_s(net)
            for r in res:
                row = {"network": net, "P": p, **r, "ring / bound":
                       "-" if bound is None else f"{r['ring (s)'] / bound:.2f}"}
                rows.append(row)
                print(row, flush=True)
    report.write("ring_transport", "hvcomm's ring over Open MPI's messages and over its own "
                 "TCP links",
                 report.setting(
                     networks="; ".join(f"{k}: {v}" for k, v in labels.items()),
                     message=f"{ELEMENTS:,} float32 ({ELEMENTS * 4 / 1e6:.1f} MB), "
                             "collectives.ring.ring_allreduce, torch's additions",
                     timing=f"{args.rounds} alternating rounds after one warm-up round; the "
                            "median of the slowest rank's time; CPU: a rank's process CPU "
                            "time over the call (all threads), the mean over ranks, the median "
                            "over rounds",
                     bound="2(P-1)/P x bytes / link rate (no latency added)",
                     oversubscription="P = 4 shares 2 cores"),
                 report.table(rows))


if __name__ == "__main__":
    main()
