"""hvcomm against PyTorch DDP (gloo), the same model on the same hosts in the same job.

Every rank runs both: hvcomm's ``DistributedOptimizer`` over MPI, and
``DistributedDataParallel`` over a gloo process group on the same hosts and the same threads
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). Each method is timed in alternating runs,
hvcomm's and DDP's in turn, each run on a fresh model from the same seed; a run's figure is
the median step (the slowest rank's) after warm-up, and a row gives the median over runs.

Methods: dense, fp16 and PowerSGD at rank 4, hvcomm's ``Compression.none``, ``.fp16`` and
``.powersgd(rank=4)`` against DDP's as :mod:`ddp_peer` sets them up (DDP's PowerSGD on a single
bucket: with several it fails on gloo).

Beside each row: the communication bound, the ring's 2(P-1)/P of the bytes each rank sends on
one link of the emulated rate (the emulated links add no latency), the step's computation
alone (forward, backward and SGD update of the same model without communication), and each
tool's CPU time per step (all of a rank's threads: computing, copying, and waiting for the wire
if it waits by polling).

Driver (default): one mpirun per (network, P); writes results/ddp.md. Worker: --worker.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ddp_peer
import report
from hvcomm.cluster.netem import check_dilation
from collectives.errors import HvcommError

WIDTH, LAYERS = 1600, 10  # 10 x (1600*1600 + 1600) = 25.6M parameters, 102 MB of float32
METHODS = ddp_peer.METHODS
RANK = 4


def _wire_bytes(method: str) -> int:
    """Bytes one rank's allreduces carry per step (before the ring's 2(P-1)/P)."""
    return ddp_peer.payload_bytes(_model().parameters(), method, RANK)


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _time_steps(comm, step, x, steps: int):
    """Per step: (the slowest rank's wall time, the ranks' mean CPU time), in seconds. The
    steps run back to back after one barrier, each timed from the start of one to the start
    of the next, so no communication still under way when ``step`` returns (an update left
    to the next forward) goes untimed."""
    comm.Barrier()
    marks = [(time.perf_counter(), time.process_time())]
    for _ in range(steps):
        step(x)
        marks.append((time.perf_counter(), time.process_time()))
    mine = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    every = comm.allgather(mine)
    return [(max(r[k][0] for r in every), sum(r[k][1] for r in every) / len(every))
            for k in range(steps)]


def _hvcomm_run(hvd, method: str, at_forward: bool):
    """``at_forward``: ``model=model``, each step's update applied at the next forward (a
    step's time then holds the previous step's communication that the forward waits for)."""
    import torch
    model = _model()
    compression = {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "powersgd": hvd.Compression.powersgd(rank=RANK)}[method]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, model=model if at_forward else None)

    def step(x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step, opt.finish_pending  # the last step's update, before the next run


def _ddp_run(method: str):
    import torch
    ddp = ddp_peer.wrap(_model(), method, RANK)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step(x):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return step, lambda: None


def _compute_only():
    import torch
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step


def worker(args) -> None:
    from mpi4py import MPI
    import torch
    import torch.distributed as dist
    import hvcomm.torch as hvd

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    os.environ["HVCOMM_RING_TRANSPORT"] = args.transport  # hvcomm's ring only: DDP has gloo
    hvd.init()
    ddp_peer.init_gloo(comm)
    x = torch.randn(args.batch, WIDTH, generator=torch.Generator().manual_seed(1 + comm.rank))
    steps = args.warmup + args.iters
    compute = [wall for wall, _ in _time_steps(comm, _compute_only(), x, steps)[args.warmup:]]
    runs = {f"{tool} {m}": [] for m in args.methods for tool in ("hvcomm", "DDP")}
    cpu = {key: [] for key in runs}
    for _ in range(args.repeats):
        for method in args.methods:
            for tool in ("hvcomm", "DDP"):
                step, close = (_hvcomm_run(hvd, method, args.at_forward) if tool == "hvcomm"
                               else _ddp_run(method))
                times = _time_steps(comm, step, x, steps)[args.warmup:]
                close()
                runs[f"{tool} {method}"].append(statistics.median(w for w, _ in times))
                cpu[f"{tool} {method}"] += [c for _, c in times]
                del step
    dist.destroy_process_group()
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"runs": runs, "cpu": cpu,
                                              "compute_s": statistics.median(compute)}))


def bound_s(method: str, p: int, net: str, dilate: float = 1):
    """The ring's transfer time of the method's bytes on one link (slowed ``dilate`` times),
    None on shared memory."""
    if net == "shm":
        return None
    return ddp_peer.ring_bytes(_wire_bytes(method), p) * 8 * dilate / report.parse_rate_bit_s(net)


def rows_for(net: str, label: str, p: int, res: dict, methods=METHODS, dilate: float = 1):
    rows = []
    for method in methods:
        h, d = res["runs"][f"hvcomm {method}"], res["runs"][f"DDP {method}"]
        hs, ds = statistics.median(h), statistics.median(d)
        hc, dc = (statistics.median(res["cpu"][f"{t} {method}"]) for t in ("hvcomm", "DDP"))
        b = bound_s(method, p, net, dilate)
        rows.append({
            "network": label, "P": p, "method": method,
            "DDP step (s)": f"{ds:.3f}", "hvcomm step (s)": f"{hs:.3f}",
            "hvcomm speed / DDP": f"{ds / hs:.2f}",
            "runs (hvcomm; DDP)": f"{min(h):.3f}-{max(h):.3f}; {min(d):.3f}-{max(d):.3f}",
            "comm bound (s)": "-" if b is None else f"{b:.3f}",
            "hvcomm / bound": "-" if b is None else f"{hs / b:.2f}",
            "DDP / bound": "-" if b is None else f"{ds / b:.2f}",
            "CPU per step (hvcomm; DDP, s)": f"{hc:.3f}; {dc:.3f}",
            "compute alone (s)": f"{res['compute_s']:.3f}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nets", nargs="+", default=["shm", "1gbit", "10gbit"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--at-forward", action="store_true",
                    help="hvcomm with model=model: each update applied at the next forward")
    ap.add_argument("--transport", choices=("mpi", "tcp"), default="mpi",
                    help="HVCOMM_RING_TRANSPORT for hvcomm's ring (collectives.tcp: tcp)")
    ap.add_argument("--dilate", type=float, default=1, metavar="D",
                    help="time dilation: links at rate / D, so that P = D x cores ranks, D to a "
                         "core, see the network of a cluster with a core each (P = 4 on 2 "
                         "cores: D = 2); emulated networks only (no shm in --nets)")
    ap.add_argument("--name", help="results/NAME.md (default: ddp, or ddp_dilated<D>)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    try:
        check_dilation(args.dilate)
    except HvcommError as err:
        ap.error(str(err))
    resolved = {asked: report.resolve_net(asked) for asked in args.nets}  # asked -> (net, label)
    on_shm = [asked for asked, (net, _) in resolved.items() if net == "shm"]
    if args.dilate != 1 and on_shm:
        ap.error(f"--dilate slows emulated links; {', '.join(on_shm)} would run on shared memory "
                 "(drop shm from --nets)")
    name = args.name or ("ddp" if args.dilate == 1 else f"ddp_dilated{args.dilate:g}")
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="hvcomm-ddp-"))
    for net_asked, (net, _) in resolved.items():
        for p in args.sizes:
            res = report.run_worker(p, [__file__, "--worker", "--batch",
                                        str(args.batch), "--warmup", str(args.warmup),
                                        "--iters", str(args.iters), "--repeats",
                                        str(args.repeats), "--methods", *args.methods,
                                        "--transport", args.transport,
                                        *(["--at-forward"] if args.at_forward else [])],
                                    timeout=3000, out=tmp / f"{net}-{p}.json", net=net,
                                    dilate=args.dilate)
            shown = net_asked if args.dilate == 1 else f"{net_asked} / {args.dilate:g}"
            new = rows_for(net, shown, p, res, args.methods, args.dilate)
            for r in new:
                print(r, flush=True)
            rows += new
    text = report.table(rows)
    print(text)
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    cores = os.cpu_count() or 1
    report.write(name, "hvcomm against PyTorch DDP (gloo), same model, hosts and threads",
                 report.setting(
                     model=f"{LAYERS} x Linear({WIDTH},{WIDTH}), {params:,} parameters (float32), "
                           f"batch {args.batch} per rank, plain SGD",
                     timing=f"{args.repeats} alternating runs per method and tool, each the "
                            f"median of {args.iters} steps after {args.warmup} warm-up (the "
                            "slowest rank's step; the steps back to back after one barrier, "
                            "each from its start to the next one's); rows give the median "
                            "over runs and the runs' range",
                     networks="; ".join(f"{k}: {label}" for k, (_, label) in resolved.items()),
                     oversubscription="P > 2 shares 2 cores: P = 4 and 8 are oversubscribed, "
                                      "and their steps measure the CPU as much as the network",
                     **({"dilation": f"{args.dilate:g}: every link shaped to its rate / "
                                     f"{args.dilate:g}, the bound likewise (rows: rate / D); "
                                     f"at P = {args.dilate * cores:g} "
                                     f"({args.dilate:g} ranks to each of {cores} "
                                     "cores) the computation, slowed by the sharing, keeps "
                                     "its share of the step as on a cluster with a core per "
                                     "rank; other P are dilated too much or too little"}
                        if args.dilate != 1 else {}),
                     ddp="gloo backend; dense: default 25 MiB buckets; fp16: "
                         "fp16_compress_hook; PowerSGD: powerSGD_hook, rank 4, error feedback, "
                         f"warm start, from step 2, one bucket (bucket_cap_mb="
                         f"{ddp_peer.ONE_BUCKET_MB}: with several buckets the hook fails on "
                         "gloo). hvcomm.torch.init() keeps freed memory in the process "
                         "(HVCOMM_KEEP_FREED_MEMORY); DDP, in the same processes, has it too",
                     hvcomm="DistributedOptimizer defaults (Compression.none, .fp16, "
                            f".powersgd(rank={RANK})), 25 MiB buckets for every method, "
                            f"the ring's chunks over HVCOMM_RING_TRANSPORT={args.transport}"
                            + (", and model=model: each step's update applied at the next "
                               "forward, the buckets nearest-the-output first, then from the "
                               "input on" if args.at_forward else ""),
                     threads="OMP_NUM_THREADS=1, torch.set_num_threads(1), both tools",
                     **{"CPU per step": "a rank's process CPU time (user + system, all its "
                                        "threads) over the step, the mean over ranks, the "
                                        "median over all timed steps of the runs"},
                     bound="ring transfer of the method's bytes, 2(P-1)/P x bytes / link rate "
                           f"(dense {_wire_bytes('dense') / 1e6:.1f} MB, fp16 "
                           f"{_wire_bytes('fp16') / 1e6:.1f} MB, PowerSGD "
                           f"{_wire_bytes('powersgd') / 1e6:.2f} MB); no latency added"),
                 text)


if __name__ == "__main__":
    main()
