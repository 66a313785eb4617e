"""How CPU work beside a large allreduce slows it on this machine: the main cause of the
replay's misses at P=2 (results/replay_*.md), measured without the replay.

Each rank starts hvcomm's dense allreduce of the whole model (the engine thread, as a
DistributedOptimizer does) and then, on its main thread, for ``--busy`` seconds:
- nothing (waits for the result): the allreduce alone;
- sleeps: what the replay's computation does (a GPU kernel leaves the CPU free);
- computes (NumPy ufuncs, which release the GIL): what hvcomm's own work does beside the
  communication (copies, updates, selection);
- starts another process that computes (no GIL shared, no MPI).
The slowest rank's time per repeat, and the TCP counters of every emulated host (from its
network namespace's /proc/net) summed over the ranks: retransmissions and timeouts would
mean packet loss; none means the time is lost elsewhere (in how the shared cores are
scheduled). Writes results/contention_<net>.md.

    python scripts/contention_probe.py --net 1gbit --sizes 2 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from hvcomm.sim import simulate

import report

CASES = ("alone", "main thread sleeps", "main thread computes", "another process computes")
TCP_COUNTERS = ("Tcp:RetransSegs", "TcpExt:TCPTimeouts", "TcpExt:TCPLossProbes")


def tcp_counters() -> dict:
    """This network namespace's TCP counters (/proc/net/snmp and netstat: header line, value
    line, per protocol)."""
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(path).read_text().splitlines()
        for head, values in zip(lines[::2], lines[1::2]):
            proto, *names = head.split()
            out.update({proto + name: int(v) for name, v in zip(names, values.split()[1:])})
    return out


def worker(args) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    import hvcomm.torch as hvd
    from collectives import slowest_times

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    hvd.init(comm)
    grads = torch.ones(args.elements)
    scratch = np.ones(4_000_000, np.float32)
    burner = [sys.executable, "-S", "-c",
              f"import time\nend = time.time() + {args.busy}\nwhile time.time() < end: pass"]

    def beside(case: str) -> None:
        handle = hvd.allreduce_async_(grads, op=hvd.Sum)
        end = time.perf_counter() + args.busy
        if case == "main thread sleeps":
            time.sleep(args.busy)
        elif case == "main thread computes":
            while time.perf_counter() < end:
                np.multiply(scratch, 1.0, out=scratch)
        elif case == "another process computes":
            subprocess.run(burner, check=True)
        hvd.synchronize(handle)

    rows = []
    for case in CASES:  # each with one untimed call first
        before = tcp_counters()
        times = slowest_times(comm, lambda: beside(case), args.repeats).tolist()
        after = tcp_counters()
        lost = {k: comm.allreduce(after.get(k, 0) - before.get(k, 0)) for k in TCP_COUNTERS}
        rows.append({"case": case, "times_s": times, **lost})
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--trace", default="resnet50-v100",
                    help="the allreduce carries this trace's parameter count")
    ap.add_argument("--sizes", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--busy", type=float, default=0.3, help="seconds of work beside it")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--elements", type=int, help=argparse.SUPPRESS)  # set by the driver
    report.add_net_option(ap)
    ap.set_defaults(net="1gbit")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    net, label = report.resolve_net(args.net)
    elements = simulate.LayerTrace.named(args.trace).params
    tmp, rows = Path(tempfile.mkdtemp(prefix="hvcomm-contention-")), []
    for p in args.sizes:
        res = report.run_worker(p, [__file__, "--worker", "--elements", str(elements),
                                   "--busy", str(args.busy), "--repeats", str(args.repeats)],
                               timeout=1800, out=tmp / f"{p}.json", net=net)
        alone = statistics.median(res["rows"][0]["times_s"])
        for r in res["rows"]:
            t, median = r["times_s"], statistics.median(r["times_s"])
            rows.append({"P": p, "beside the allreduce": r["case"],
                         "median ms": round(median * 1e3),
                         "min ms": round(min(t) * 1e3), "max ms": round(max(t) * 1e3),
                         "median / alone": round(median / alone, 2),
                         "each repeat ms": " ".join(f"{x * 1e3:.0f}" for x in r["times_s"]),
                         **{k.split(":")[1]: r[k] for k in TCP_COUNTERS}})
        print(report.table(rows[-len(CASES):]), flush=True)
    path = report.write(
        f"contention_{net}", "A large allreduce beside CPU work on this machine",
        report.setting(network=label, allreduce=f"hvcomm's dense allreduce (engine thread, "
                       f"Open MPI ring) of {elements:,} float32 ({args.trace}'s gradients)",
                       beside=f"{args.busy} s on each rank's main thread, started with the "
                              "allreduce", repeats=f"{args.repeats} after one untimed, the slowest rank's time "
                                      "each",
                       tcp="retransmitted segments, timeouts and loss probes, summed over the "
                           "ranks' network namespaces over a case's untimed call and repeats"),
        report.table(rows) + "\n")
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
