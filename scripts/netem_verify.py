"""Check the emulated cluster against its configuration: point-to-point bandwidth between two
hosts, one way and both ways at once (the links are full duplex; target: within 10% of the
rate each way), and a 100 MB Allreduce over 2 and 4 hosts (target: within 25% of the ring
model 2(P-1)/P * bytes / bandwidth). Writes results/netem_verify.md.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import report
from hvcomm.cluster.netem import TCP_MCA, EmulatedCluster, mca_text, parse_rate_bit_s


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    buf = np.ones(args.bytes // 4, np.float32)
    other = np.empty_like(buf)
    times = []
    for _ in range(args.repeats + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        if args.mode == "p2p":
            if comm.rank == 0:
                comm.Send(buf, dest=1)
            elif comm.rank == 1:
                comm.Recv(buf, source=0)
            comm.Barrier()  # the sender's timer stops when the receiver has everything
        elif args.mode == "exchange":
            if comm.rank < 2:
                comm.Sendrecv(buf, dest=1 - comm.rank, recvbuf=other, source=1 - comm.rank)
        else:
            comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"median_s": float(np.median(times[1:]))}))


def measure(hosts: int, rate: str, mode: str, nbytes: int, repeats: int, tmp: Path,
            algorithm: str = "ring") -> float:
    with EmulatedCluster(hosts, rate, mpi_allreduce=algorithm) as cluster:
        out = tmp / f"{mode}-{rate}-{hosts}-{algorithm}.json"
        argv = [__file__, "--worker", "--mode", mode, "--bytes", str(nbytes), "--repeats",
                str(repeats), "--out", str(out)]
        proc = cluster.mpirun(argv, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} at {rate} failed:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return json.loads(out.read_text())["median_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", choices=["p2p", "exchange", "allreduce"])
    ap.add_argument("--bytes", type=int)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    tmp = Path(tempfile.mkdtemp(prefix="hvcomm-netem-"))
    rows = []
    for mode, rate, nbytes in (("p2p", "1gbit", 125_000_000), ("p2p", "100mbit", 25_000_000),
                               ("exchange", "1gbit", 125_000_000)):
        t = measure(2, rate, mode, nbytes, args.repeats, tmp)
        bw = nbytes * 8 / t
        test = "Send/Recv, 2 hosts" if mode == "p2p" else "Sendrecv both ways, 2 hosts (each way)"
        rows.append({"test": test, "link": rate, "bytes": f"{nbytes:,}",
                     "measured s": f"{t:.3f}", "measured": f"{bw / 1e6:.0f} Mbit/s",
                     "model": f"{parse_rate_bit_s(rate) / 1e6:.0f} Mbit/s",
                     "measured/model": f"{bw / parse_rate_bit_s(rate):.3f}", "target": "within 10%",
                     "ok": abs(bw / parse_rate_bit_s(rate) - 1) <= 0.10})
        print(rows[-1], flush=True)
    nbytes, rate = 100_000_000, "1gbit"
    for p, algorithm in ((2, "ring"), (4, "ring"), (4, "default")):
        model = 2 * (p - 1) / p * nbytes * 8 / parse_rate_bit_s(rate)
        t = measure(p, rate, "allreduce", nbytes, args.repeats, tmp, algorithm)
        rows.append({"test": f"Allreduce, {p} hosts, Open MPI {algorithm} algorithm", "link": rate,
                     "bytes": f"{nbytes:,}", "measured s": f"{t:.3f}", "measured": f"{t:.3f} s",
                     "model": f"{model:.3f} s (ring)", "measured/model": f"{t / model:.3f}",
                     "target": "within 25%" if algorithm == "ring" else "(for information)",
                     "ok": abs(t / model - 1) <= 0.25 if algorithm == "ring" else "-"})
        print(rows[-1], flush=True)
    text = report.table(rows)
    print(text)
    report.write("netem_verify", "Emulated network: measured against configured", report.setting(
        network="emulated cluster: one network namespace per host, veth into a bridge, tc tbf "
        "both ways, no added latency (this kernel has no netem)",
        mpi_transport="Open MPI ob1/tcp, " + mca_text(TCP_MCA),
        timing=f"median of {args.repeats} after one warm-up, slowest rank"), text)
    if not all(r["ok"] for r in rows if r["ok"] != "-"):
        raise SystemExit("some figures are outside their targets (see the table)")


if __name__ == "__main__":
    main()
