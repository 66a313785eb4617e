"""Dense MPI Allreduce vs Top-k AllGather vs gTopKAllReduce: measured time beside the
alpha-beta prediction, each sparse collective's local compute beside its total, and the bytes
each rank sends; and the dense sum in float16 (``hvcomm.torch.sums.sum_in_place``, as
hvcomm.torch's fp16 compression runs it: half the bytes) beside float32's and beside MPI's own
float16 Allreduce (which hvcomm.torch does not use). The sparse
collectives run with their default settings (input check on).

Driver (default): one mpirun per P; prints and writes results/collectives_<net>.md.
Worker (--worker, under mpirun): times every (d, density) on its communicator.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


import report


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    import collectives as C
    import torch

    from hvcomm.torch.sums import sum_in_place

    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    cal = C.calibrate(comm)
    ab = cal.alpha_beta
    rows = []
    for d in args.d:
        grad = np.random.default_rng([d, r]).standard_normal(d).astype(np.float32)
        for density in args.density:
            k = max(int(density * d), 1)
            idx = C.select_topk(grad, k)
            val = grad[idx]
            pair = idx.itemsize + val.itemsize
            out = np.empty_like(grad)
            t_dense = C.time_collective(
                comm, lambda: C.allreduce(comm, grad, out, check=False), args.repeats)
            # summed in place as hvcomm.torch sums it (torch's casts), a fresh copy per call
            # made before the clock starts
            halves = iter([torch.from_numpy(grad.astype(np.float16))
                           for _ in range(args.repeats + 1)])
            t_half = C.time_collective(comm, lambda: sum_in_place(comm, next(halves)),
                                       args.repeats)
            half, half_out = grad.astype(np.float16), np.empty(d, np.float16)
            t_mpi_half = C.time_collective(
                comm, lambda: comm.Allreduce(half, half_out, op=MPI.SUM), args.repeats)
            res = {"ag": [], "gt": []}
            t_ag = C.time_collective(comm, lambda: res["ag"].append(
                C.topk_allgather(comm, idx, val, d, k)), args.repeats)
            t_gt = C.time_collective(comm, lambda: res["gt"].append(
                C.gtopk_allreduce(comm, idx, val, d, k)), args.repeats)
            sent = np.array([res["ag"][-1].sent_bytes, res["gt"][-1].sent_bytes], np.int64)
            comm.Allreduce(MPI.IN_PLACE, sent, op=MPI.MAX)
            # local compute: this rank's median over the timed calls, then the slowest rank
            compute = np.array([np.median([x.compute_s for x in res[c][1:]]) for c in ("ag", "gt")])
            comm.Allreduce(MPI.IN_PLACE, compute, op=MPI.MAX)
            rows.append({
                "P": p, "d": d, "density": density, "k": k,
                "dense s": t_dense, "dense model s": C.ring_allreduce_s(p, grad.nbytes, ab),
                "dense fp16 s": t_half, "fp16 / dense": t_half / t_dense,
                "MPI's fp16 s": t_mpi_half, "MPI's fp16 / dense": t_mpi_half / t_dense,
                "allgather s": t_ag, "allgather compute s": compute[0],
                "allgather model s": C.topk_allgather_s(p, k, pair, ab),
                "gtopk s": t_gt, "gtopk compute s": compute[1],
                "gtopk model s": C.gtopk_allreduce_s(p, k, pair, ab),
                "allgather / dense": t_ag / t_dense, "gtopk / dense": t_gt / t_dense,
                "allgather / model": t_ag / C.topk_allgather_s(p, k, pair, ab),
                "gtopk / model": t_gt / C.gtopk_allreduce_s(p, k, pair, ab),
                "dense MB sent": 2 * (p - 1) / p * grad.nbytes / 1e6,
                "allgather MB sent": float(sent[0]) / 1e6, "gtopk MB sent": float(sent[1]) / 1e6,
            })
    if r == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "alpha_s": ab.alpha_s,
                                              "beta_s_per_byte": ab.beta_s_per_byte}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="values of P")
    ap.add_argument("--d", type=int, nargs="+", default=[1_000_000, 26_214_400])
    ap.add_argument("--density", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", help="results/<name>.md (default: collectives_<net>)")
    report.add_net_option(ap)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    net, label = report.resolve_net(args.net)
    rows, fits, tmp = [], [], Path(tempfile.mkdtemp(prefix="hvcomm-coll-"))
    for p in args.sizes:
        argv = [__file__, "--worker", "--repeats", str(args.repeats), "--d", *map(str, args.d),
                "--density", *map(str, args.density)]
        res = report.run_worker(p, argv, timeout=1800, out=tmp / f"{p}.json",
                                net=net)
        rows += res["rows"]
        fits.append(f"P={p}: alpha = {res['alpha_s'] * 1e6:.1f} us, "
                    f"1/beta = {8 / max(res['beta_s_per_byte'], 1e-30) / 1e9:.2f} Gbit/s")
        print(report.table(res["rows"]), flush=True)
    text = report.table(rows) + "\n\nCalibrated on the live communicator (allreduce sweep):\n\n" \
        + "\n".join(f"- {f}" for f in fits)
    path = report.write(args.name or f"collectives_{net}",
                        "Collectives: dense vs Top-k AllGather vs gTop-k",
                        report.setting(network=label, values="float32, indices int32",
                                       timing=f"median of {args.repeats} runs of the slowest rank, "
                                       "after one warm-up; ranks beyond 2 are oversubscribed",
                                       model="alpha-beta, alpha and beta fitted by "
                                       "collectives.calibrate"), text)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
