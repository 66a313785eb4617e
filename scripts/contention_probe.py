"""Why a large allreduce on the emulated network sometimes took a whole ring phase longer, and
which of Open MPI's TCP settings cures it: the main cause of the replay's misses at P=2
(results/replay_*.md), measured without the replay.

For each setting of Open MPI's TCP transport (SETTINGS) and each P, one mpirun in which every
rank starts hvcomm's dense allreduce of the whole model (the engine thread, as a
DistributedOptimizer does) and then, on its main thread, for ``--busy`` seconds:
- nothing (waits for the result): the allreduce alone;
- sleeps: what the replay's computation does (a GPU kernel leaves the CPU free);
- computes (NumPy ufuncs, which release the GIL): what hvcomm's own work does beside the
  communication (copies, updates, selection);
- starts another process that computes (no GIL shared, no MPI).
Recorded: the slowest rank's time per repeat; TCP counters summed over the ranks' network
namespaces (retransmissions and timeouts would mean packet loss); and, at P=2, from ``ss -ti``
sampled in rank 0's namespace during the run, how long the one connection between the two
ranks carried data one way only (a lost phase: the link's two directions running one after the
other instead of together). Then the allreduce alone at ``--fast-net`` (default 10gbit), to
show what each setting costs where the CPU, not the link, is the limit. Writes
results/contention_<net>.md.

    python scripts/contention_probe.py --net 1gbit --sizes 2 4
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hvcomm.cluster.netem import TCP_MCA, EmulatedCluster, mca_text
from hvcomm.sim import simulate

import report

CASES = ("alone", "main thread sleeps", "main thread computes", "another process computes")
TCP_COUNTERS = ("Tcp:RetransSegs", "TcpExt:TCPTimeouts", "TcpExt:TCPLossProbes")
# Open MPI's TCP transport settings tried (hvcomm.cluster.netem.TCP_MCA explains the cause)
SETTINGS = {
    "as shipped": {},
    "256 KiB put fragments": {"btl_tcp_rdma_pipeline_frag_size": "262144"},
    "1 MiB put fragments": {"btl_tcp_rdma_pipeline_frag_size": "1048576"},
    "no put, 128 KiB sends (the default)": TCP_MCA,
    "2 connections per peer": {"btl_tcp_links": "2"},
}
SS_PERIOD_S = 0.05
ONE_WAY_BYTES = 512 * 1024  # an interval moved this much one way ...
IDLE_BYTES = 64 * 1024      # ... and under this the other way: the link ran one way only


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
    for case in args.cases:
        before = tcp_counters()
        times, spans = [], []
        for repeat in range(args.repeats + 1):  # one untimed call first
            comm.Barrier()
            start, t0 = time.time(), time.perf_counter()
            beside(case)
            took = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if repeat:
                times.append(took)
                spans.append((start, start + took))
        after = tcp_counters()
        lost = {k: comm.allreduce(after.get(k, 0) - before.get(k, 0)) for k in TCP_COUNTERS}
        rows.append({"case": case, "times_s": times, "spans": spans, **lost})
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows}))


def sample_connections(namespace: str, stop: threading.Event, samples: list) -> None:
    """Append (time, {connection: (bytes_acked, bytes_received)}) for every TCP connection of
    ``namespace`` to another emulated host, every SS_PERIOD_S, until ``stop``."""
    while not stop.is_set():
        t = time.time()
        out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-tinH"],
                             capture_output=True, text=True).stdout.splitlines()
        conns = {}
        for line, info in zip(out, out[1:]):
            ends = re.search(r"(198\.1[89]\.\S+:\d+)\s+(198\.1[89]\.\S+:\d+)\s*$", line)
            if ends:
                sent = re.search(r"bytes_acked:(\d+)", info)
                got = re.search(r"bytes_received:(\d+)", info)
                conns[f"{ends.group(1)}>{ends.group(2)}"] = (int(sent.group(1)) if sent else 0,
                                                             int(got.group(1)) if got else 0)
        samples.append((t, conns))
        stop.wait(SS_PERIOD_S)


def one_way_s(samples: list, spans) -> float:
    """Seconds within ``spans`` during which a connection moved data one way only."""
    total = 0.0
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if not any(s <= t0 and t1 <= e for s, e in spans):
            continue
        for conn, (sent1, got1) in b.items():
            sent0, got0 = a.get(conn, (sent1, got1))
            moved = sorted((sent1 - sent0, got1 - got0))
            if moved[1] >= ONE_WAY_BYTES and moved[0] < IDLE_BYTES:
                total += t1 - t0
                break
    return total


def probe(p: int, net: str, tcp_mca: dict, args, elements: int, cases, tmp: Path) -> dict:
    out = tmp / "probe.json"
    argv = [__file__, "--worker", "--elements", str(elements), "--busy", str(args.busy),
            "--repeats", str(args.repeats), "--cases", *cases, "--out", str(out)]
    samples, stop = [], threading.Event()
    with EmulatedCluster(hosts=p, rate=net, tcp_mca=tcp_mca) as cluster:
        sampler = threading.Thread(target=sample_connections,
                                   args=(cluster.namespace(0), stop, samples))
        if p == 2:
            sampler.start()
        try:
            proc = cluster.mpirun(argv, timeout=1800)
        finally:
            stop.set()
            if sampler.is_alive():
                sampler.join()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"probe at P={p} failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    res = json.loads(out.read_text())
    for r in res["rows"]:
        r["one_way_s"] = one_way_s(samples, r["spans"]) if p == 2 else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--trace", default="resnet50-v100",
                    help="the allreduce carries this trace's parameter count")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--busy", type=float, default=0.3, help="seconds of work beside it")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--fast-net", default="10gbit",
                    help="where each setting's cost is measured (the allreduce alone, P=2)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--elements", type=int, help=argparse.SUPPRESS)  # set by the driver
    report.add_net_option(ap)
    ap.set_defaults(net="1gbit")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    net, label = report.resolve_net(args.net)
    if net == "shm":
        sys.exit("contention_probe: needs an emulated network (root, network namespaces)")
    elements = simulate.LayerTrace.named(args.trace).params
    tmp, rows, costs = Path(tempfile.mkdtemp(prefix="hvcomm-contention-")), [], []
    for name in args.settings:
        for p in args.sizes:
            res = probe(p, net, SETTINGS[name], args, elements, CASES, tmp)
            alone = statistics.median(res["rows"][0]["times_s"])
            for r in res["rows"]:
                t, median = r["times_s"], statistics.median(r["times_s"])
                rows.append({"TCP setting": name, "P": p, "beside the allreduce": r["case"],
                             "median ms": round(median * 1e3),
                             "max ms": round(max(t) * 1e3),
                             "median / alone": round(median / alone, 2),
                             "each repeat ms": " ".join(f"{x * 1e3:.0f}" for x in t),
                             "one-way ms": "" if r["one_way_s"] is None
                             else round(r["one_way_s"] * 1e3),
                             **{k.split(":")[1]: r[k] for k in TCP_COUNTERS}})
            print(report.table(rows[-len(CASES):]), flush=True)
        fast = probe(2, args.fast_net, SETTINGS[name], args, elements, CASES[:1], tmp)
        t = fast["rows"][0]["times_s"]
        costs.append({"TCP setting": name, "P": 2, "median ms": round(statistics.median(t) * 1e3),
                      "each repeat ms": " ".join(f"{x * 1e3:.0f}" for x in t)})
        print(report.table(costs[-1:]), flush=True)
    body = (report.table(rows) + f"\n\nThe same allreduce alone at {args.fast_net} (the CPU, "
            "not the link, limits it there):\n\n" + report.table(costs) +
            "\n\nThe settings (Open MPI MCA parameters):\n\n" +
            "\n".join(f"- {name}: `{mca_text(SETTINGS[name]) or '(none)'}`"
                      for name in args.settings) + "\n")
    path = report.write(
        f"contention_{net}", "A large allreduce beside CPU work, under Open MPI's TCP settings",
        report.setting(network=label.split(", MPI over TCP")[0] + ", MPI over TCP",
                       allreduce=f"hvcomm's dense allreduce (engine thread, Open MPI ring) of "
                                 f"{elements:,} float32 ({args.trace}'s gradients)",
                       beside=f"{args.busy} s on each rank's main thread, started with the "
                              "allreduce",
                       repeats=f"{args.repeats} after one untimed, the slowest rank's time each",
                       tcp="retransmitted segments, timeouts and loss probes, summed over the "
                           "ranks' network namespaces over a case's untimed call and repeats",
                       one_way=f"P=2: time within the timed repeats during which rank 0's "
                               f"connection to rank 1 moved >= {ONE_WAY_BYTES // 1024} KiB one "
                               f"way and < {IDLE_BYTES // 1024} KiB the other in a "
                               f"{SS_PERIOD_S * 1e3:.0f} ms sample of `ss -ti` (a phase of "
                               "the ring at 1 Gbit/s moves 51 MB each way, 0.41 s at line rate)"),
        body)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
