"""Iteration time of every method at any number of workers, from a per-layer trace (pure: no
MPI calls, no torch).

A :class:`LayerTrace` gives, for one iteration of one worker, each layer's parameters and its
forward and backward time. A :class:`Network` gives the alpha-beta cost of a message. From
them :func:`iteration` predicts one method's iteration time at P workers:

- dense S-SGD under hvcomm's schedules (``wfbp``, ``single``, ``threshold``, ``mgwfbp``):
  the planner's pipeline (:mod:`hvcomm.planner`) with the ring allreduce's cost at P;
- ``topk`` (Top-k AllGather) and ``gtopk`` (gTopKAllReduce), one message of k pairs after
  backward, plus the local compute: top-k selection over the d gradients, and merging
  (gTop-k: ceil(log2 P) merges of 2k pairs; AllGather: the sum of P*k pairs);
- ``p3``: every parameter cut into slices of ``slice_elems`` elements, one allreduce each (with
  the ranks' readiness vector appended), always the ready slice closest to the input first; the
  next iteration's forward of a layer waits only for that layer's slices and its share of the
  update (an event simulation of a few iterations, the steady period);
- ``od-sgd`` and ``ssd-sgd``: dense allreduce of the whole model overlapped with the next
  iteration's forward and backward (one message per iteration, its cost hidden up to the
  computation's length; SSD-SGD's resets every k steps are local and cost no communication);
- ``cd-sgd``: OD-SGD's skeleton sending 1-byte codes (2-bit quantisation summed as int8), and
  the full-precision gradient every ``delay_k``-th step: the mean over the k steps.

Compute costs per element (:class:`ComputeCost`) come from the trace's device: this
machine's measured figures for a CPU trace, a stated assumption for a GPU trace (:data:`COMPUTE`);
a caller can pass its own.
Scaling efficiency is the iteration time of one worker (computation only) over the iteration
time at P, i.e. throughput(P) / (P * throughput(1)).
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from collectives.cost import (AlphaBeta, gtopk_allreduce_s, ring_allreduce_s,
                              topk_allgather_s)
from collectives.errors import HvcommError
from collectives.sparse import ceil_log2

from .. import planner

DENSE = ("wfbp", "single", "threshold", "mgwfbp")
DELAYED = ("od-sgd", "ssd-sgd", "cd-sgd")
METHODS = (*DENSE, "p3", "topk", "gtopk", *DELAYED)
TRACES = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    forward_s: float
    backward_s: float
    shapes: Tuple[Tuple[int, ...], ...] = ()   # its parameter tensors' shapes, if known


@dataclass(frozen=True)
class LayerTrace:
    """One worker's iteration: layers in forward order, the optimizer update after
    communication, the batch per worker, and where the times come from."""

    model: str
    layers: Tuple[Layer, ...]
    batch: int
    update_s: float = 0.0
    bytes_per_param: int = 4
    source: str = ""
    device: str = "cpu"      # where the times come from: "cpu" (measured here) or "gpu"

    @property
    def compute_s(self) -> float:
        """Forward, backward and update of one worker with no communication."""
        return sum(l.forward_s + l.backward_s for l in self.layers) + self.update_s

    @property
    def params(self) -> int:
        return sum(l.params for l in self.layers)

    def planner_trace(self) -> planner.Trace:
        """The planner's view: gradients in backward order (last layer first), each ready when
        its layer's backward ends."""
        t = sum(l.forward_s for l in self.layers)
        ready, nbytes = [], []
        for layer in reversed(self.layers):
            t += layer.backward_s
            if layer.params:
                ready.append(t)
                nbytes.append(layer.params * self.bytes_per_param)
        return planner.Trace(tuple(ready), tuple(nbytes), self.update_s, backward_end_s=t)

    @classmethod
    def named(cls, name: str) -> "LayerTrace":
        """A trace by file path (``*.json``) or by name in hvcomm/sim/traces (``resnet50-v100``)."""
        path = Path(name) if name.endswith(".json") else TRACES / f"{name}.json"
        if not path.exists():
            raise HvcommError(f"no trace {name!r}; available in hvcomm/sim/traces: "
                              f"{', '.join(available_traces())} (scripts/make_traces.py adds more)")
        return cls.load(path)

    @classmethod
    def load(cls, path) -> "LayerTrace":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, data: dict) -> "LayerTrace":
        """A trace from the JSON layout of hvcomm/sim/traces (scripts/make_traces.py)."""
        layers = tuple(Layer(l["name"], int(l["params"]), float(l["forward_s"]),
                             float(l["backward_s"]),
                             tuple(tuple(int(n) for n in shape) for shape in l.get("shapes", ())))
                       for l in data["layers"])
        return cls(data["model"], layers, int(data["batch"]), float(data.get("update_s", 0.0)),
                   int(data.get("bytes_per_param", 4)), data.get("source", ""),
                   data.get("device", "cpu"))


def available_traces() -> List[str]:
    return sorted(p.stem for p in TRACES.glob("*.json"))


@dataclass(frozen=True)
class Network:
    """Per-message latency and link bandwidth between workers (one link per worker)."""

    name: str
    alpha_s: float
    bandwidth_bit_s: float

    @property
    def alpha_beta(self) -> AlphaBeta:
        return AlphaBeta.from_link(self.alpha_s, self.bandwidth_bit_s)


# latencies: typical MPI-over-TCP small-message latency on Ethernet (tens of microseconds),
# and verbs latency on InfiniBand EDR; assumptions, stated, not measured here
NETWORKS = {
    "1gbit": Network("1gbit", 50e-6, 1e9),
    "10gbit": Network("10gbit", 30e-6, 10e9),
    "25gbit": Network("25gbit", 20e-6, 25e9),
    "100gbit": Network("100gbit", 10e-6, 100e9),
    "ib-edr": Network("ib-edr", 2e-6, 100e9),
}


def network(name: str) -> Network:
    if name not in NETWORKS:
        raise HvcommError(f"unknown network {name!r}; choose one of {sorted(NETWORKS)}")
    return NETWORKS[name]


@dataclass(frozen=True)
class ComputeCost:
    """Local compute of the sparse methods, seconds per element."""

    select_s_per_element: float   # top-k of d gradients (threshold and mask)
    merge_s_per_pair: float       # gTop-k tree step: merge, sum, select, per input pair
    sum_s_per_pair: float         # AllGather: summing the P*k gathered pairs


COMPUTE = {
    # this machine, one core: bench_selection.py (d=25M: ~0.1 s) and the compute columns of
    # results/collectives_shm.md (gTop-k P=2: 0.79 ms for 2k=52K pairs)
    "cpu": ComputeCost(4.0e-9, 1.5e-8, 1.0e-8),
    # a GPU: selection and merging at about a tenth of the CPU's per-element time (an
    # assumption: memory-bound kernels at ~10x the bandwidth), not measured here
    "gpu": ComputeCost(4.0e-10, 1.5e-9, 1.0e-9),
}
@dataclass(frozen=True)
class Prediction:
    method: str
    workers: int
    iteration_s: float
    compute_s: float        # one worker's computation (the P=1 iteration)
    batch: int

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.workers * self.batch / self.iteration_s

    @property
    def efficiency(self) -> float:
        return self.compute_s / self.iteration_s


def iteration(method: str, trace: LayerTrace, workers: int, net: Network,
              density: float = 0.001, compute: Optional[ComputeCost] = None,
              threshold_bytes: int = 25 << 20, local_s: Optional[float] = None,
              slice_elems: int = 50_000, delay_k: int = 5) -> Prediction:
    """Predicted iteration time of ``method`` at ``workers`` (see the module's docstring).
    ``compute`` defaults to the costs of the trace's device (:data:`COMPUTE`). ``slice_elems``:
    P3's slice; ``delay_k``: CD-SGD's full-precision period (hvcomm's defaults). ``local_s``:
    a measured per-iteration cost beyond the trace on one worker (the method's selection and
    error feedback, the framework's hooks and update), e.g. a replay on a one-rank
    communicator minus the trace (scripts/replay.py runs P of them at once, sharing the cores
    as the P workers do); it then stands in for the modelled selection cost, and is on the
    critical path."""
    if method not in METHODS:
        raise HvcommError(f"unknown method {method!r}; choose one of {METHODS}")
    if workers < 1:
        raise HvcommError(f"workers must be >= 1, got {workers}")
    if not 0 < density <= 1:
        raise HvcommError(f"density must be in (0, 1], got {density}")
    if slice_elems < 1 or delay_k < 1:
        raise HvcommError(f"slice_elems and delay_k must be >= 1, got {slice_elems}, {delay_k}")
    p, ab, base = workers, net.alpha_beta, trace.compute_s
    compute = compute or COMPUTE[trace.device]
    d = trace.params
    sparse = method in ("topk", "gtopk")
    extra = local_s if local_s is not None else \
        (d * compute.select_s_per_element if sparse else 0.0)
    if p == 1:  # one worker communicates and compresses nothing
        return Prediction(method, 1, base + (local_s or 0.0), base, trace.batch)
    if method in DENSE:
        cost = planner.Cost(2 * (p - 1) * ab.alpha_s, 2 * (p - 1) / p * ab.beta_s_per_byte)
        t = planner.predict(method, trace.planner_trace(), cost, threshold_bytes).iteration_s
        return Prediction(method, p, t + extra, base, trace.batch)
    if method == "p3":
        return Prediction(method, p, _p3_period(trace, p, ab, slice_elems) + extra, base,
                          trace.batch)
    nbytes = d * trace.bytes_per_param
    if method in DELAYED:
        busy = base - trace.update_s + extra
        dense = max(busy, ring_allreduce_s(p, nbytes, ab))
        if method == "cd-sgd":  # k-1 steps of int8 codes, then one at full precision
            coded = max(busy, ring_allreduce_s(p, d, ab))
            return Prediction(method, p, ((delay_k - 1) * coded + dense) / delay_k +
                              trace.update_s, base, trace.batch)
        return Prediction(method, p, dense + trace.update_s, base, trace.batch)
    k = max(int(density * d), 1)
    pair = 4 + trace.bytes_per_param
    if method == "gtopk":
        comm = gtopk_allreduce_s(p, k, pair, ab) + \
            ceil_log2(p) * 2 * k * compute.merge_s_per_pair
    else:
        comm = topk_allgather_s(p, k, pair, ab) + p * k * compute.sum_s_per_pair
    return Prediction(method, p, base + extra + comm, base, trace.batch)


def _p3_period(trace: LayerTrace, p: int, ab: AlphaBeta, slice_elems: int,
               iterations: int = 5) -> float:
    """P3's steady-state iteration time (see the module's docstring): an event simulation of
    ``iterations`` iterations, the period between the last two starts. One wire, one slice at
    a time; when nothing known to be ready is left, the ranks exchange their readiness (one
    small allreduce) once a gradient is ready, as hvcomm's P3 does."""
    tensors = [(li, n) for li, layer in enumerate(trace.layers)
               for n in ([math.prod(s) for s in layer.shapes] or ([layer.params]
                                                                  if layer.params else []))]
    vector = len(tensors) * trace.bytes_per_param        # readiness, appended to each slice
    negotiation = ring_allreduce_s(p, 8 * len(tensors), ab)
    done = [0.0] * len(trace.layers)  # when each layer's slices of the last iteration were summed
    t = wire = 0.0
    starts = []
    for _ in range(iterations):
        starts.append(t)
        for li, layer in enumerate(trace.layers):  # forward: each layer waits for its update
            if layer.params:
                t = max(t, done[li]) + trace.update_s * layer.params / trace.params
            t += layer.forward_s
        ready = [0.0] * len(trace.layers)
        for li in reversed(range(len(trace.layers))):
            t += trace.layers[li].backward_s
            ready[li] = t
        # slices in priority order (tensor order = forward order), each with its ready time
        slices = [(ti, ready[li], li, min(slice_elems, n - lo))
                  for ti, (li, n) in enumerate(tensors) for lo in range(0, n, slice_elems)]
        left = [0] * len(trace.layers)
        for _, _, li, _ in slices:
            left[li] += 1
        pending = sorted(slices, key=lambda s: s[1])
        heap: list = []
        at = 0
        while at < len(pending) or heap:
            if not heap:  # the wire idles until the next gradient, then a negotiation
                wire = max(wire, pending[at][1]) + negotiation
            while at < len(pending) and pending[at][1] <= wire:
                heapq.heappush(heap, pending[at])
                at += 1
            _, _, li, elems = heapq.heappop(heap)
            wire += ring_allreduce_s(p, elems * trace.bytes_per_param + vector, ab)
            left[li] -= 1
            if not left[li]:
                done[li] = wire
    return starts[-1] - starts[-2]


def compare(trace: LayerTrace, workers: int, net: Network, density: float = 0.001,
            compute: Optional[ComputeCost] = None,
            methods: Sequence[str] = METHODS) -> List[Prediction]:
    """Every method's prediction, fastest first."""
    return sorted((iteration(m, trace, workers, net, density, compute) for m in methods),
                  key=lambda r: r.iteration_s)
