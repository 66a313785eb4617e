"""Where hvcomm's ring allreduce beats Open MPI's: the crossover that sets
``collectives.ring.RING_MIN_BYTES``, and the 16-bit sums.

For each message size, in one job per (network, P), alternating calls of:
- float32: Open MPI's Allreduce (as the emulated cluster configures it: its ring algorithm) and
  hvcomm's ring (``collectives.ring.ring_allreduce``, torch's additions as hvcomm.torch runs it);
- float16: the ring in float16; Open MPI's Allreduce of the widened float32 (hvcomm's path below
  the crossover); Open MPI's own float16 Allreduce; and the previous float16 exchange
  (``collectives.dense.icast_allreduce``: Alltoallv + Allgatherv, summed in float32).
Each figure is the median over repeats of the slowest rank's time. Writes
results/ring_crossover.md (rows of every network and P, the ring model beside them).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import report

SIZES = [1 << s for s in range(12, 27, 2)]  # 4 KiB ... 64 MiB


def _time(comm, call, repeats):
    import collectives as C
    return C.time_collective(comm, call, repeats)


def _sum_pieces_torch(pieces, ws):
    """icast_allreduce's addition with torch's casts, as hvcomm.torch ran it before the ring."""
    import numpy as np
    import torch
    m = pieces.shape[1]
    acc = torch.from_numpy(ws.get("acc", m, np.float32))
    wide = torch.from_numpy(ws.get("wide", m, np.float32))
    acc.copy_(torch.from_numpy(pieces[0]))
    for q in range(1, pieces.shape[0]):
        wide.copy_(torch.from_numpy(pieces[q]))
        acc.add_(wide)
    out = ws.get("sum", m, np.float16)
    torch.from_numpy(out).copy_(acc)
    return out


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from collectives import icast_allreduce, kernels
    from collectives.ring import ring_allreduce
    from hvcomm.torch.sums import add_torch

    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in args.sizes:
        n32 = nbytes // 4
        # summed in place call after call: inputs of 1/P^3 (and 2-valued: exact) keep every
        # result finite over the calls, so the 16-bit kernels run on ordinary numbers
        start = np.full(n32, 2.0 ** -30, np.float32)
        x32, x16 = start.copy(), start.astype(np.float16)
        wide = np.empty(x16.size, np.uint32)
        out16 = np.empty_like(x16)

        def widened():
            kernels.widen16(x16.view(np.uint16), wide, False)
            comm.Allreduce(MPI.IN_PLACE, wide.view(np.float32), op=MPI.SUM)
            kernels.narrow16(wide, x16.view(np.uint16), False)

        calls = {
            "f32 Open MPI": lambda: comm.Allreduce(MPI.IN_PLACE, x32, op=MPI.SUM),
            "f32 ring": lambda: ring_allreduce(comm, x32, add=add_torch, check=False),
            "f16 ring": lambda: ring_allreduce(comm, x16, add=add_torch, check=False),
            "f16 widened Open MPI": widened,
            "f16 Open MPI": lambda: comm.Allreduce(x16, out16, op=MPI.SUM),
            "f16 Alltoallv+Allgatherv": lambda: icast_allreduce(comm, x16,
                                                                _sum_pieces_torch).wait(),
        }
        times = {k: [] for k in calls}
        for _ in range(args.rounds):  # alternate, so that drift hits every call alike
            for name, call in calls.items():
                times[name].append(_time(comm, call, args.repeats))
        rows.append({"bytes (float32)": nbytes,
                     **{k: float(np.median(v)) for k, v in times.items()}})
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nets", nargs="+", default=["shm", "1gbit", "10gbit"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--net", default="shm", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    tmp = Path(tempfile.mkdtemp(prefix="hvcomm-ring-"))
    rows, labels = [], {}
    for asked in args.nets:
        net, labels[asked] = report.resolve_net(asked)
        for p in args.ranks:
            res = report.run_worker(p, [__file__, "--worker", "--repeats", str(args.repeats),
                                        "--rounds", str(args.rounds), "--sizes",
                                        *map(str, args.sizes)],
                                    timeout=3000, out=tmp / f"{net}-{p}.json", net=net)
            for r in res:
                model = None if net == "shm" else \
                    2 * (p - 1) / p * r["bytes (float32)"] * 8 / report.parse_rate_bit_s(net)
                row = {"network": net, "P": p, **{k: (f"{v:.4g}" if isinstance(v, float) else v)
                                                   for k, v in r.items()},
                       "f32 ring / Open MPI": f"{r['f32 ring'] / r['f32 Open MPI']:.2f}",
                       "f16 ring / Alltoallv+Allgatherv":
                           f"{r['f16 ring'] / r['f16 Alltoallv+Allgatherv']:.2f}",
                       "f16 ring / widened Open MPI":
                           f"{r['f16 ring'] / r['f16 widened Open MPI']:.2f}",
                       "f32 ring / model": "-" if model is None else f"{r['f32 ring'] / model:.2f}"}
                rows.append(row)
                print(row, flush=True)
    text = report.table(rows)
    print(text)
    report.write("ring_crossover", "hvcomm's ring allreduce against Open MPI's, by message size",
                 report.setting(
                     networks="; ".join(f"{k}: {v}" for k, v in labels.items()),
                     timing=f"{args.rounds} alternating rounds of {args.repeats} calls each; the "
                            "median of the rounds' medians of the slowest rank's time (s)",
                     sizes="bytes of the float32 message; the float16 one has half",
                     ring="collectives.ring over Open MPI's messages, chunks of "
                          f"{__import__('collectives.ring').ring.CHUNK_BYTES['mpi']} bytes, "
                          "torch's additions",
                     model="2(P-1)/P x float32 bytes / link rate (the emulated links add no "
                           "latency)",
                     oversubscription="P = 4 shares 2 cores"),
                 text)


if __name__ == "__main__":
    main()
